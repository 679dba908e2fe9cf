"""Exact resume: a run stopped at any step and resumed ends bit-for-bit where the straight run ends.

Run with rng_mode=per_worker, where the workers' own RNG streams must be saved and restored.
Each case trains 3 epochs of 12 steps (200 samples, batch 16) on a dataset whose items draw from the
workers' torch, numpy and python RNGs, so a slip in any stream changes the weights.
"""

import os
import signal
import subprocess
import sys

import pytest
import torch

from {{ cookiecutter.package }}.engine import resume
from {{ cookiecutter.package }}.engine.schedule import WarmupCosine
from tests.helpers import (
    NOT_A_PICKLE,
    PROJECT,
    RNG_DATA,
    load_ckpt,
    printed_resume,
    read_jsonl,
    run_train,
    same_weights,
    wait_for_steps,
)

# Each worker's own RNG streams, captured and restored: the mode whose exactness needs the most care.
DATA = [*RNG_DATA, "rng_mode=per_worker"]

STEPS = 36  # 3 epochs x 12 batches


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted runs, one per loader setup, trained on first use."""
    done = {}

    def get(*overrides):
        if overrides not in done:
            run_dir = tmp_path_factory.mktemp("straight")
            run_train(run_dir, *DATA, "epochs=3", *overrides)
            done[overrides] = run_dir
        return done[overrides]

    return get


def interrupted_then_resumed(tmp_path, k, *overrides):
    first, second = tmp_path / "first", tmp_path / "second"
    run_train(first, *DATA, "epochs=3", f"max_steps={k}", *overrides)
    run_train(second, *DATA, "epochs=3", f"resume={first}/checkpoints/last.pth", *overrides)
    return first, second


@pytest.mark.parametrize(
    "k, overrides",
    [
        pytest.param(12, ("loader=memory-tight", "log_every_steps=1"), marks=pytest.mark.slow),  # an epoch boundary
        (13, ("loader=balanced", "log_every_steps=1")),  # mid-epoch, not a multiple of W: the fast tier
        pytest.param(17, ("loader=throughput", "log_every_steps=1"), marks=pytest.mark.slow),
        # the default log interval: a stop inside an interval
        pytest.param(7, ("loader=balanced", "loader.num_workers=3"), marks=pytest.mark.slow),
        pytest.param(10, ("loader=memory-tight", "loader.num_workers=4", "log_every_steps=1"), marks=pytest.mark.slow),
        pytest.param(25, ("loader=balanced", "loader.num_workers=0"), marks=pytest.mark.slow),
    ],
)
def test_resume_is_exact(tmp_path, straight, k, overrides):
    reference = straight(*overrides)
    first, second = interrupted_then_resumed(tmp_path, k, *overrides)
    assert same_weights(reference / "checkpoints/last.pth", second / "checkpoints/last.pth")
    logged = read_jsonl(first / "steps.jsonl") + read_jsonl(second / "steps.jsonl")
    # the same record: the lines of the stopped and the resumed run together are the straight run's, losses equal
    straight_lines = read_jsonl(reference / "steps.jsonl")
    assert [(r["step"], r["loss"]) for r in logged] == [(r["step"], r["loss"]) for r in straight_lines]
    if "log_every_steps=1" not in overrides:  # one line per interval, and at each epoch's end
        assert [r["step"] for r in logged] == [10, 12, 20, 24, 30, 36]
    # a stop on an epoch's last step validates that epoch first; a stop inside one leaves it to the resumed run
    assert [r["epoch"] for r in read_jsonl(second / "metrics.jsonl")] == list(range(k // 12, 3))


@pytest.mark.parametrize("profile", ["memory-tight", "balanced"])
@pytest.mark.slow
def test_resume_from_an_epoch_end_checkpoint(tmp_path, straight, profile):
    """The checkpoint written after epoch 0's validation (position 0 of epoch 1)."""
    reference = straight(f"loader={profile}")
    boundary = load_ckpt(reference / "checkpoints/step-00000012.pth")
    assert (boundary["epoch"], boundary["ranks"][0]["loader"]["position"]) == (1, 0)
    run_train(tmp_path, *DATA, "epochs=3", f"loader={profile}", f"resume={reference}/checkpoints/step-00000012.pth")
    assert same_weights(reference / "checkpoints/last.pth", tmp_path / "checkpoints/last.pth")
    assert [r["epoch"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]


@pytest.mark.slow
def test_negative_control_reseeded_workers_differ(tmp_path, straight):
    """The same resume with the worker streams dropped (workers reseeded, as peers do) must not match."""
    overrides = ("loader=balanced",)
    reference = straight(*overrides)
    first = tmp_path / "first"
    run_train(first, *DATA, "epochs=3", "max_steps=13", *overrides)
    ckpt = load_ckpt(first / "checkpoints/last.pth")
    ckpt["ranks"][0]["loader"]["worker_streams"] = None
    torch.save(ckpt, tmp_path / "reseeded.pth")
    run_train(tmp_path / "second", *DATA, "epochs=3", f"resume={tmp_path / 'reseeded.pth'}", *overrides)
    assert not same_weights(reference / "checkpoints/last.pth", tmp_path / "second/checkpoints/last.pth")


@pytest.mark.slow
def test_resume_on_image_files_with_augmentation(tmp_path, shapes):
    run_train(tmp_path / "straight", *shapes)
    run_train(tmp_path / "first", *shapes, "max_steps=7")
    run_train(tmp_path / "second", *shapes, f"resume={tmp_path}/first/checkpoints/last.pth")
    assert same_weights(tmp_path / "straight/checkpoints/last.pth", tmp_path / "second/checkpoints/last.pth")


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 0), (signal.SIGUSR1, 0), (signal.SIGINT, 130)])
@pytest.mark.slow
def test_signal_saves_then_resume_is_exact(tmp_path, straight, signum, code):
    reference = straight("loader=balanced")
    run_dir = tmp_path / "first"
    cmd = [sys.executable, "train.py", *DATA, "epochs=3", "loader=balanced", f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(cmd, cwd=PROJECT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for_steps(run_dir, 3)
    proc.send_signal(signum)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == code, out[-2000:]
    stopped = load_ckpt(run_dir / "checkpoints/last.pth")["step"]
    assert 3 <= stopped < STEPS
    run_train(tmp_path / "second", *DATA, "epochs=3", "loader=balanced", f"resume={run_dir}/checkpoints/last.pth")
    assert same_weights(reference / "checkpoints/last.pth", tmp_path / "second/checkpoints/last.pth")


@pytest.mark.slow
def test_periodic_checkpoints_keep_the_newest(tmp_path):
    run_train(tmp_path, *DATA, "epochs=1", "checkpoint.every_steps=5", "checkpoint.keep=2")
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["best.pth", "last.pth", "step-00000010.pth", "step-00000012.pth"]
    assert load_ckpt(tmp_path / "checkpoints/step-00000010.pth")["ranks"][0]["loader"]["position"] == 10


@pytest.mark.slow
def test_resume_latest_takes_the_newest_that_fits(tmp_path):
    """resume=latest skips newer checkpoints of another run (here epochs differs), saying so, and names its pick."""
    outputs = tmp_path / "outputs"
    run_train(outputs / "old", *DATA, "epochs=1", "max_steps=2")
    run_train(outputs / "new", *DATA, "epochs=1", "max_steps=4")
    run_train(outputs / "other", *DATA, "epochs=2", "max_steps=3")  # the newest file, but another run
    proc = run_train(
        tmp_path / "resumed",
        *DATA,
        "epochs=1",
        "resume=latest",
        f"checkpoint.search_dir={outputs}",
        "log_every_steps=1",
    )
    out = proc.stdout + proc.stderr
    assert read_jsonl(tmp_path / "resumed/steps.jsonl")[0]["step"] == 5  # log_every_steps=1: the step after step 4
    assert f"skipping {outputs / 'other/checkpoints/last.pth'}: its run differs: epochs 2 -> 1" in out, out
    assert f"resuming from {outputs / 'new/checkpoints/last.pth'} (step 4)" in out
    # none fits (another seed): start fresh and say why, never continue another run
    proc = run_train(
        tmp_path / "fresh",
        *DATA,
        "epochs=1",
        "max_steps=1",
        "log_every_steps=1",
        "seed=7",
        "resume=latest",
        f"checkpoint.search_dir={outputs}",
    )
    assert read_jsonl(tmp_path / "fresh/steps.jsonl")[0]["step"] == 1
    assert "fits this run (3 skipped); starting fresh" in proc.stdout + proc.stderr


def test_the_closing_line_fits_a_line(tmp_path, monkeypatch):
    """The default run folder, below where the command runs: relative paths, all on one line."""
    run_dir = tmp_path / "outputs/2026-12-01/10-00-00_train_balanced"
    last = run_dir / "checkpoints/last.pth"
    monkeypatch.chdir(tmp_path)
    rel = "outputs/2026-12-01/10-00-00_train_balanced"
    line = resume.where(run_dir, last, 296, True, [], False)
    assert line == (f"finished at step 296; run folder {rel}; to train longer: resume={rel}/checkpoints/last.pth "
                    "with more epochs= and resume_strict=false (docs/resume.md)")  # fmt: skip
    line = resume.where(run_dir, last, 3, False, ["not bit-exact (put_)"], True)
    assert line == (f"stopped at step 3; run folder {rel}; not bit-exact (put_); to continue: the same command with "
                    f"resume={rel}/checkpoints/last.pth and a max_steps above 3 (or none)")  # fmt: skip
    assert "\n" not in line
    # negative control: a run outside the working directory keeps its absolute path
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert f"resume={last} " in resume.where(run_dir, last, 296, True, [], False)


@pytest.mark.slow
def test_the_closing_line_says_where_and_how_to_continue(tmp_path):
    proc = run_train(tmp_path / "first", *DATA, "epochs=1", "max_steps=3", "log_every_steps=1")
    last = tmp_path / "first/checkpoints/last.pth"
    (line,) = [x for x in proc.stdout.splitlines() if "stopped at step 3; run folder" in x]
    assert line.endswith(f"run folder {tmp_path / 'first'}; to continue: the same command with resume={last} "
                         "and a max_steps above 3 (or none)")  # fmt: skip
    done = run_train(tmp_path / "second", *DATA, "epochs=1", "log_every_steps=1", *printed_resume(proc.stdout))
    assert [r["step"] for r in read_jsonl(tmp_path / "second/steps.jsonl")] == list(range(4, 13))
    assert "finished at step 12;" in done.stdout and f"; to train longer: resume={tmp_path}/second/" in done.stdout


@pytest.mark.slow
def test_more_epochs_replan_the_schedule_when_not_strict(tmp_path):
    """epochs=2 run, then epochs=4: the lr from step 25 on is the 4-epoch schedule's, ending at its floor, never the
    2-epoch schedule's floor carried on (what a restored LambdaLR would do)."""
    lr, warmup, floor = 0.05, 4, 0.01
    run_train(tmp_path / "first", *DATA, "epochs=2", f"schedule.warmup_steps={warmup}")
    proc = run_train(
        tmp_path / "second",
        *DATA,
        "epochs=4",
        f"schedule.warmup_steps={warmup}",
        "resume_strict=false",
        f"resume={tmp_path}/first/checkpoints/last.pth",
        "log_every_steps=1",
    )
    assert "going on with changed settings: epochs 2 -> 4" in proc.stdout + proc.stderr
    before, after = read_jsonl(tmp_path / "first/steps.jsonl"), read_jsonl(tmp_path / "second/steps.jsonl")
    assert before[-1]["lr"] == pytest.approx(lr * floor)  # the old plan had reached its floor: the failure mode
    plan = WarmupCosine(warmup, 4 * 12, floor)  # steps.jsonl holds the lr set after step s, i.e. factor(s)
    assert [r["step"] for r in after] == list(range(25, 49))
    assert [r["lr"] for r in after] == pytest.approx([lr * plan(r["step"]) for r in after], rel=1e-12)
    assert after[0]["lr"] > 10 * lr * floor and after[-1]["lr"] == pytest.approx(lr * floor)
    assert read_jsonl(tmp_path / "second/metrics.jsonl")[-1]["lr"] == pytest.approx(lr * floor)


@pytest.mark.slow
def test_speed_and_logging_changes_keep_the_run_exact(tmp_path):
    """Under rng_mode=per_sample the loader's performance keys, monitor and checkpoint cadence do not change the run:
    a resume may change them (an info line lists them) and still ends bit for bit on the straight run."""
    per_sample = [*RNG_DATA, "epochs=2"]
    run_train(tmp_path / "straight", *per_sample)
    run_train(tmp_path / "first", *per_sample, "max_steps=7")
    proc = run_train(
        tmp_path / "second",
        *per_sample,
        "loader.num_workers=1",
        "loader.prefetch_factor=1",
        "monitor.every_steps=3",
        "checkpoint.keep=1",
        f"resume={tmp_path}/first/checkpoints/last.pth",
    )
    assert (
        "changed settings that keep the run the same: checkpoint.keep 3 -> 1, loader.num_workers 2 -> 1, "
        "loader.prefetch_factor 2 -> 1, monitor.every_steps 50 -> 3"
    ) in proc.stdout + proc.stderr
    assert same_weights(tmp_path / "straight/checkpoints/last.pth", tmp_path / "second/checkpoints/last.pth")


class Exploit:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


@pytest.mark.slow
def test_bad_checkpoints_are_refused_in_one_line(tmp_path, straight):
    good = straight("loader=balanced") / "checkpoints/last.pth"
    data = good.read_bytes()
    (tmp_path / "truncated.pth").write_bytes(data[: len(data) // 2])
    (tmp_path / "random.pth").write_bytes(NOT_A_PICKLE)  # torch warns on these before it refuses them
    torch.save({"model": Exploit()}, tmp_path / "malicious.pth")
    torch.save({"hello": 1}, tmp_path / "foreign.pth")
    cases = {
        "missing.pth": "no checkpoint at",
        "truncated.pth": "not a readable checkpoint",
        "random.pth": "not a readable checkpoint",
        "malicious.pth": "not a readable checkpoint",
        "foreign.pth": "not a checkpoint of this project",
    }
    for name, message in cases.items():
        run_dir = tmp_path / f"run-{name}"
        proc = run_train(run_dir, *DATA, "loader=balanced", f"resume={tmp_path / name}", expect=2)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: resume:") and message in lines[0], proc.stderr
        assert not (run_dir / "checkpoints/last.pth").exists()
    assert not (PROJECT / "pwned").exists() and not (tmp_path / "pwned").exists()
    assert good.read_bytes() == data  # nothing overwritten


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("model=resnet18",), "model._target_ {{ cookiecutter.package }}.model.SmallCNN -> {{ cookiecutter.package }}.model.resnet18"),
        (("data.num_classes=5",), "data.num_classes 4 -> 5"),
        (("optim=adamw",), "optim._target_ torch.optim.SGD -> torch.optim.AdamW"),
        (("loader.num_workers=3",), "loader.num_workers 2 -> 3"),  # per_worker: the workers' streams feed the data
        (("epochs=8", "optim.lr=0.1"), "epochs 3 -> 8, optim.lr 0.05 -> 0.1"),
        (("seed=1", "loader.batch_size=20"), "loader.batch_size 16 -> 20, seed 0 -> 1"),
        (("schedule.min_lr_ratio=0.1",), "schedule.min_lr_ratio 0.01 -> 0.1"),
    ],
)
@pytest.mark.slow
def test_mismatched_resume_is_refused(tmp_path, straight, overrides, message):
    good = straight("loader=balanced") / "checkpoints/last.pth"
    proc = run_train(tmp_path, *DATA, "loader=balanced", f"resume={good}", *overrides, expect=2)
    assert message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "resume_strict=false" in proc.stderr
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.slow
def test_changed_workers_continue_when_not_strict(tmp_path):
    run_train(tmp_path / "first", *DATA, "epochs=2", "max_steps=5")
    proc = run_train(
        tmp_path / "second",
        *DATA,
        "epochs=2",
        "loader.num_workers=1",
        "resume_strict=false",
        f"resume={tmp_path}/first/checkpoints/last.pth",
    )
    assert "no longer exact" in proc.stdout + proc.stderr
    assert load_ckpt(tmp_path / "second/checkpoints/last.pth")["step"] == 24


def test_a_checkpoint_records_the_versions_of_the_libraries_its_targets_come_from():
    found = resume.versions({"model": {"_target_": "sklearn.linear_model.LogisticRegression"}, "optim": {"lr": 0.1}})
    assert {"torch", "torchvision", "numpy", "python", "scikit-learn"} <= found.keys(), found
    own = resume.versions({"task": {"_target_": "{{ cookiecutter.package }}.tasks.Classification"}})
    assert own.keys() == {"torch", "torchvision", "numpy", "python"}  # the project's own package is not a library


@pytest.mark.slow  # two resumes
def test_a_resume_under_other_library_versions_says_so(tmp_path):
    run_train(tmp_path / "first", *DATA, "epochs=1", "max_steps=2")
    ckpt = torch.load(tmp_path / "first/checkpoints/last.pth", weights_only=True)
    same = run_train(tmp_path / "same", *DATA, "epochs=1", f"resume={tmp_path}/first/checkpoints/last.pth")
    assert "library versions differ" not in same.stdout + same.stderr  # the control
    ckpt["versions"]["torch"] = "2.0.0"
    torch.save(ckpt, tmp_path / "older.pth")
    proc = run_train(tmp_path / "older", *DATA, "epochs=1", f"resume={tmp_path}/older.pth")
    assert "library versions differ from the checkpoint's (torch 2.0.0 -> 2." in proc.stdout + proc.stderr
