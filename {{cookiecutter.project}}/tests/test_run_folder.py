"""One run, one folder (engine/preflight.py): runs that resolve the same folder name get folders of their own, the
ranks of one torchrun job take rank 0's, and a refusal under torchrun is one line from one rank, nothing written."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from {{ cookiecutter.package }}.engine.preflight import claim, unclaim
from tests.helpers import PROJECT, load_ckpt, read_jsonl, run_train, same_weights, torchrun_cmd
{% if cookiecutter.with_fsdp == "yes" %}
from tests.test_fsdp import BLOCKS, export  # a sharded run: every rank writes its own shards into the folder
{% endif %}


def test_a_folder_another_run_holds_gives_the_next_name(tmp_path):
    first = claim(str(tmp_path / "day/run"))
    assert first == str(tmp_path / "day/run") and (tmp_path / "day/run/.hydra").is_dir()
    assert claim(str(tmp_path / "day/run")) == f"{first}-2"
    assert claim(str(tmp_path / "day/run")) == f"{first}-3"
    (tmp_path / "empty").mkdir()  # made beforehand, no run in it yet: taken
    assert claim(str(tmp_path / "empty")) == str(tmp_path / "empty")


def test_a_refusal_removes_the_folders_its_claim_made_and_nothing_else(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs/kept").mkdir(parents=True)  # a sibling: its parent stays
    run_dir = Path(claim(str(tmp_path / "outputs/day/run")))
    (run_dir / "train.log").write_text("")  # Hydra's job log, opened before train() runs
    unclaim(run_dir)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["outputs", "outputs/kept"]
    # a folder holding a run (its record written) is left as it is: the control
    (tmp_path / "outputs/kept/.hydra").mkdir()
    (tmp_path / "outputs/kept/.hydra/config.yaml").write_text("seed: 0\n")
    unclaim(tmp_path / "outputs/kept")
    assert (tmp_path / "outputs/kept/.hydra/config.yaml").read_text() == "seed: 0\n"


def test_a_used_folder_named_again_without_resume_is_not_written_into(tmp_path, shapes, shapes_run):
    shutil.copytree(shapes_run, tmp_path / "run")  # a finished run of `shapes` (seed 0) holds the folder
    proc = run_train(tmp_path / "run", *shapes, "max_steps=1", "seed=1")
    assert f"this one writes to {tmp_path}/run-2" in proc.stdout + proc.stderr
    assert load_ckpt(tmp_path / "run/checkpoints/last.pth")["config"]["seed"] == 0
    assert load_ckpt(tmp_path / "run-2/checkpoints/last.pth")["config"]["seed"] == 1


@pytest.mark.slow
def test_four_runs_started_at_once_keep_four_folders_and_each_resumes_exactly(tmp_path, shapes):
    base = [*shapes, "epochs=3"]
    for seed in range(4):  # also makes the data set once, before the runs that start together
        run_train(tmp_path / f"straight{seed}", *base, f"seed={seed}")
    here = tmp_path / "here"
    here.mkdir()
    runs = [
        subprocess.Popen([sys.executable, str(PROJECT / "train.py"), *base, f"seed={seed}", "max_steps=7"], cwd=here,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for seed in range(4)
    ]  # fmt: skip
    outputs = [run.communicate(timeout=300)[0] for run in runs]
    assert [run.returncode for run in runs] == [0] * 4, outputs
    folders = sorted(p.parent.parent for p in here.glob("outputs/*/*/checkpoints/last.pth"))
    assert len(folders) == 4
    seeds = []
    for folder in folders:
        seed = load_ckpt(folder / "checkpoints/last.pth")["config"]["seed"]
        seeds.append(seed)
        assert [line["step"] for line in read_jsonl(folder / "metrics.jsonl")] == [5]
        assert [line["step"] for line in read_jsonl(folder / "steps.jsonl")] == [5]  # every 10 steps, epoch ends
        run_train(folder, *base, f"seed={seed}", f"resume={folder}/checkpoints/last.pth")
        assert same_weights(folder / "checkpoints/last.pth", tmp_path / f"straight{seed}/checkpoints/last.pth")
        assert [line["step"] for line in read_jsonl(folder / "metrics.jsonl")] == [5, 10, 15]
    assert sorted(seeds) == [0, 1, 2, 3]


@pytest.mark.slow
def test_torchrun_ranks_that_resolve_other_times_share_rank_0s_folder_and_resume_exactly(tmp_path, shapes):
{% if cookiecutter.with_fsdp == "yes" %}
    run = [f"data.root={shapes[0].split('=', 1)[1]}", *BLOCKS]
{% else %}
    run = [*shapes, "loader.batch_size=12"]  # 6 steps an epoch on 2 ranks: max_steps=5 stops mid-epoch
{% endif %}
    apart = f"hydra.run.dir={tmp_path}/at-" + "${now:%S%f}"  # to the microsecond: no two ranks resolve the same
    command = [*torchrun_cmd(tmp_path / "straight", *run)[:-1], apart]
    assert subprocess.run(command, cwd=PROJECT, capture_output=True, timeout=600).returncode == 0
    (straight,) = tmp_path.glob("at-*")
    stop = [*torchrun_cmd(tmp_path, *run, "max_steps=5")[:-1], apart]
    assert subprocess.run(stop, cwd=PROJECT, capture_output=True, timeout=600).returncode == 0
    (stopped,) = set(tmp_path.glob("at-*")) - {straight}
    resume = torchrun_cmd(stopped, *run, f"resume={stopped}/checkpoints/last.pth")
    proc = subprocess.run(resume, cwd=PROJECT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
{% if cookiecutter.with_fsdp == "yes" %}
    a = export(straight / "checkpoints/last.pth", tmp_path / "a.pth")
    b = export(stopped / "checkpoints/last.pth", tmp_path / "b.pth")
    assert all(a["model"][k].equal(b["model"][k]) for k in a["model"])
{% else %}
    assert same_weights(straight / "checkpoints/last.pth", stopped / "checkpoints/last.pth")
{% endif %}


@pytest.mark.slow
def test_a_refusal_under_torchrun_is_one_line_from_one_rank_and_writes_nothing(tmp_path):
    proc = subprocess.run(torchrun_cmd(tmp_path / "run", "optim.lr=-1"), cwd=PROJECT, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
    assert errors == ["error: optim.lr must be a number > 0, got -1"]
    # torchrun's report: the first rank to exit exited with 2 (the other may be stopped by torchrun by then)
    assert proc.returncode != 0 and "exitcode  : 2" in proc.stdout + proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_sweep_under_torchrun_is_refused_in_one_line_and_writes_nothing(tmp_path):
    """Each rank would sweep by itself, in a folder of its own: one line from one rank instead, nothing written.
    (A sweep's processes come from a launcher{% if cookiecutter.with_slurm == "yes" %}: test_slurm.py's two-task job shares the one folder it resolved{% endif %}.)"""
    command = torchrun_cmd(tmp_path / "unused", "-m", "seed=0,1", f"hydra.sweep.dir={tmp_path}/sweep-" + "${now:%S%f}")
    proc = subprocess.run(command, cwd=PROJECT, capture_output=True, text=True, timeout=300)
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: a sweep (-m) cannot run under torchrun: "), errors
    # torchrun's report: the first rank to exit exited with 2 (the other, refusing alone, may be stopped by then)
    assert proc.returncode != 0 and "exitcode  : 2" in proc.stdout + proc.stderr
    assert not list(tmp_path.iterdir())
