"""The optional parts (cookiecutter.json's with_*): a part answered `no` leaves no file, config key or group, extra,
test, docs/ page or README section of its own behind, no link to what it took away, and the project without it is
still ruff-clean and trains."""
import re
import subprocess
import sys

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: requirements-dev.txt brings tomli there
    import tomli as tomllib

PARTS = ("with_tracking", "with_shards", "with_streams", "with_slurm", "with_benchmarks", "with_fsdp", "with_photos",
         "with_doctor")
MINIMAL = {part: "no" for part in PARTS}

# What each part brings: paths, and words that name it (in any text file of the bake: code, YAML, README, tests)
LEFT_OUT = {
    "with_tracking": (["my_trainer/engine/tracking.py", "conf/logger", "tests/test_tracking.py", "docs/tracking.md"],
                      [r"mlflow", r"wandb", r"W&B", r"logger\.use", r"conf/logger", r"Experiment tracking",
                       r"tracking\.md"]),
    "with_shards": (["my_trainer/shards.py", "conf/data/shards.yaml", "tests/test_shards.py", "benchmarks/p6_shards.py",
                     "docs/shards.md"],
                    [r"ShardDataset", r"data=shards", r"webdataset", r"\.shards pack", r"Tar shards", r"shards\.md"]),
    "with_streams": (["my_trainer/stream.py", "my_trainer/engine/stream_loader.py", "my_trainer/engine/shard_plan.py",
                      "conf/data/jsonlines.yaml", "tests/test_stream.py", "tests/test_stream_loader.py",
                      "tests/test_stream_train.py", "tests/test_shard_plan.py", "docs/streams.md"],
                     [r"StreamLoader", r"stream_resume", r"restart_epoch", r"JsonLines", r"data=jsonlines", r"ShardStream",
                      r"shard_plan", r"EvalStream", r"is_stream", r"[Ss]hard stream", r"\[Streams\]",
                      r"streams\.md"]),
    "with_slurm": (["my_trainer/engine/slurm.py", "conf/hydra", "tests/test_slurm.py", "docs/slurm.md"],
                   [r"submitit", r"hydra/launcher", r"slurm\.py", r"\[slurm\]", r"SLURM with submitit", r"slurm\.md"]),
    "with_benchmarks": (["benchmarks", "docs/benchmarks.md"], [r"benchmarks[/.]", r"gpu_check", r"# Benchmarks"]),
    "with_fsdp": (["my_trainer/engine/fsdp.py", "conf/parallel/fsdp.yaml",
                   "tests/test_fsdp.py", "tests/blocks.py"],
                  [r"FSDP", r"fully_shard", r"parallel=fsdp", r"ShardedCheckpointer", r"shard_modules",
                   r"reshard_after_forward", r"group_of_one", r"share_buffers", r"is_sharded", r"tests\.blocks"]),
    "with_photos": (["my_trainer/engine/decode.py", "tests/test_gpu_decode.py", "benchmarks/p7_photos.py",
                     "docs/photos.md"],
                    [r"CropDecoder", r"crop_plan", r"gpu_decode", r"data\.decode", r"decode=gpu",
                     r"nvJPEG", r"EncodedBatch", r"to_images", r"p7_photos", r"\[Photos\]", r"photos\.md"]),
    "with_doctor": (["my_trainer/doctor.py", "tests/test_doctor.py"],
                    [r"(?i)doctor", r"\.doctor", r"doctor\.py", r"test_doctor", r"doctor\.json", r"pss_mib\(\)"]),
}
EXTRAS = {"with_tracking": {"mlflow", "wandb"}, "with_slurm": {"slurm"}, "with_benchmarks": {"bench"}}


def texts(project):
    for path in sorted(project.rglob("*")):
        if path.is_file() and b"\0" not in path.read_bytes():
            yield path.relative_to(project), path.read_text()


def left_out(project, part) -> list[str]:
    """Where the bake still holds something of `part`, one line each ([]: nothing)."""
    paths, words = LEFT_OUT[part]
    found = [f"{p} exists" for p in paths if (project / p).exists()]
    for rel, text in texts(project):
        found += [f"{rel}: {w}" for w in words if re.search(w, text)]
    extras = tomllib.loads((project / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    found += [f"extra [{name}]" for name in EXTRAS.get(part, set()) & extras.keys()]
    return found


def ruff_clean(project) -> None:
    for command in (["check", "."], ["format", "--check", "."]):
        proc = subprocess.run([sys.executable, "-m", "ruff", *command, "--no-cache"], cwd=project,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"ruff {' '.join(command)}:\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}"


def docs_hold_together(project) -> None:
    """The bake's own tests/test_docs.py: README.md short, every link of README.md and docs/ leading somewhere (a link
    to a page the part took away would not)."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_docs.py"],
                          cwd=project, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]


def trains(project, tmp_path) -> None:
    run_dir = tmp_path / "debug-run"
    proc = subprocess.run([sys.executable, "train.py", "experiment=debug", f"hydra.run.dir={run_dir}"], cwd=project,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run_dir / "checkpoints/last.pth").is_file() and (run_dir / "metrics.jsonl").read_text().count("\n") == 2


@pytest.mark.parametrize("part", PARTS)
def test_a_part_answered_no_leaves_nothing_of_itself_and_the_project_trains(bake, tmp_path, part):
    project = bake(tmp_path / "bake", **{part: "no"})
    assert left_out(project, part) == []
    others = [p for p in PARTS if p != part]
    assert all(left_out(project, p) for p in others)  # the other parts are all there
    ruff_clean(project)
    docs_hold_together(project)
    trains(project, tmp_path)


def test_every_part_answered_no(bake, tmp_path):
    project = bake(tmp_path / "bake", **MINIMAL)
    assert {part: left_out(project, part) for part in PARTS} == {part: [] for part in PARTS}
    ruff_clean(project)
    docs_hold_together(project)
    trains(project, tmp_path)


def test_every_part_answered_yes_is_the_default(bake, tmp_path):
    """The default bake holds every part: the check above can fail."""
    project = bake(tmp_path / "bake")
    assert all(left_out(project, part) for part in PARTS)


def test_without_fsdp_parallel_fsdp_is_an_unknown_group_option(bake, tmp_path):
    project = bake(tmp_path / "bake", with_fsdp="no")
    proc = subprocess.run([sys.executable, "train.py", "parallel=fsdp"], cwd=project, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["error: parallel=fsdp: there is no conf/parallel/fsdp.yaml; choose one of ddp"]
