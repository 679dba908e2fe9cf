"""Exact resume: a run stopped at any step and resumed ends bit-for-bit where the straight run ends.

Run with rng_mode=per_worker, where the workers' own RNG streams must be saved and restored.
Each case trains 3 epochs of 12 steps (200 samples, batch 16) on a dataset whose items draw from the
workers' torch, numpy and python RNGs, so a slip in any stream changes the weights.
"""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.helpers import PROJECT, RNG_DATA, load_ckpt, read_jsonl, run_train, same_weights, wait_for_steps

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
        (12, ("loader=memory-tight", "log_every_steps=1")),  # an epoch boundary
        (13, ("loader=balanced", "log_every_steps=1")),  # mid-epoch, not a multiple of num_workers
        (17, ("loader=throughput", "log_every_steps=1")),
        (7, ("loader=balanced", "loader.num_workers=3")),  # the default log interval: a stop inside an interval
        (10, ("loader=memory-tight", "loader.num_workers=4", "log_every_steps=1")),
        (25, ("loader=balanced", "loader.num_workers=0")),
    ],
)
def test_resume_is_exact(tmp_path, straight, k, overrides):
    reference = straight(*overrides)
    first, second = interrupted_then_resumed(tmp_path, k, *overrides)
    assert same_weights(reference / "checkpoints/last.pth", second / "checkpoints/last.pth")
    logged = read_jsonl(first / "steps.jsonl") + read_jsonl(second / "steps.jsonl")
    if "log_every_steps=1" in overrides:  # one line per step: every loss is the straight run's
        assert [r["loss"] for r in logged] == [r["loss"] for r in read_jsonl(reference / "steps.jsonl")]
    else:  # one line per interval; the stop at step k closes one early
        assert read_jsonl(first / "steps.jsonl")[-1]["step"] == k
        assert [r["step"] for r in read_jsonl(reference / "steps.jsonl")] == [10, 12, 20, 24, 30, 36]
    # max_steps stops before the epoch's validation, so the resumed run validates that epoch first
    assert [r["epoch"] for r in read_jsonl(second / "metrics.jsonl")] == list(range((k - 1) // 12, 3))


@pytest.mark.parametrize("profile", ["memory-tight", "balanced"])
def test_resume_from_an_epoch_end_checkpoint(tmp_path, straight, profile):
    """The checkpoint written after epoch 0's validation (position 0 of epoch 1)."""
    reference = straight(f"loader={profile}")
    boundary = load_ckpt(reference / "checkpoints/step-00000012.pth")
    assert (boundary["epoch"], boundary["ranks"][0]["loader"]["position"]) == (1, 0)
    run_train(tmp_path, *DATA, "epochs=3", f"loader={profile}", f"resume={reference}/checkpoints/step-00000012.pth")
    assert same_weights(reference / "checkpoints/last.pth", tmp_path / "checkpoints/last.pth")
    assert [r["epoch"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]


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


def test_resume_on_image_files_with_augmentation(tmp_path, shapes):
    run_train(tmp_path / "straight", *shapes)
    run_train(tmp_path / "first", *shapes, "max_steps=7")
    run_train(tmp_path / "second", *shapes, f"resume={tmp_path}/first/checkpoints/last.pth")
    assert same_weights(tmp_path / "straight/checkpoints/last.pth", tmp_path / "second/checkpoints/last.pth")


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 0), (signal.SIGUSR1, 0), (signal.SIGINT, 130)])
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


def test_periodic_checkpoints_keep_the_newest(tmp_path):
    run_train(tmp_path, *DATA, "epochs=1", "checkpoint.every_steps=5", "checkpoint.keep=2")
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["last.pth", "step-00000010.pth", "step-00000012.pth"]
    assert load_ckpt(tmp_path / "checkpoints/step-00000010.pth")["ranks"][0]["loader"]["position"] == 10


def test_resume_latest_finds_the_newest(tmp_path):
    outputs = tmp_path / "outputs"
    run_train(outputs / "old", *DATA, "epochs=1", "max_steps=2")
    run_train(outputs / "new", *DATA, "epochs=1", "max_steps=4")
    run_train(tmp_path / "resumed", *DATA, "epochs=1", "resume=latest", f"checkpoint.search_dir={outputs}",
              "log_every_steps=1")
    assert read_jsonl(tmp_path / "resumed/steps.jsonl")[0]["step"] == 5


SAVER = """
import sys, torch
from {{ cookiecutter.package }}.checkpoint import Checkpointer
saver = Checkpointer(__import__("pathlib").Path(sys.argv[1]), keep=1)
step = 0
while True:
    step += 1
    saver.save({"step": step, "blob": torch.full((4_000_000,), float(step))})
    print(step, flush=True)
"""


def test_kill_9_during_save_leaves_last_readable(tmp_path):
    for delay in (0.05, 0.2, 0.45, 0.7, 1.1):
        proc = subprocess.Popen([sys.executable, "-c", SAVER, str(tmp_path)], cwd=PROJECT, stdout=subprocess.PIPE, text=True)
        proc.stdout.readline()  # at least one save finished
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        state = load_ckpt(tmp_path / "last.pth")
        assert torch.equal(state["blob"], torch.full((4_000_000,), float(state["step"])))


class Exploit:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_bad_checkpoints_are_refused_in_one_line(tmp_path, straight):
    good = straight("loader=balanced") / "checkpoints/last.pth"
    data = good.read_bytes()
    (tmp_path / "truncated.pth").write_bytes(data[: len(data) // 2])
    (tmp_path / "random.pth").write_bytes(os.urandom(4096))
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
        (("model=resnet18",), "model"),
        (("data.num_classes=5",), "num_classes 4 there, 5 here"),
        (("optim=adamw",), "optim"),
        (("loader.num_workers=3",), "num_workers 2 -> 3"),
    ],
)
def test_mismatched_resume_is_refused(tmp_path, straight, overrides, message):
    good = straight("loader=balanced") / "checkpoints/last.pth"
    proc = run_train(tmp_path, *DATA, "loader=balanced", f"resume={good}", *overrides, expect=2)
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_changed_workers_continue_when_not_strict(tmp_path):
    run_train(tmp_path / "first", *DATA, "epochs=2", "max_steps=5")
    proc = run_train(tmp_path / "second", *DATA, "epochs=2", "loader.num_workers=1", "resume_strict=false",
                     f"resume={tmp_path}/first/checkpoints/last.pth")
    assert "no longer exact" in proc.stdout + proc.stderr
    assert load_ckpt(tmp_path / "second/checkpoints/last.pth")["step"] == 24
