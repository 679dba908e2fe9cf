"""A worker that hangs: loader.timeout names it, writes the workers' stacks, saves the last step and exits 75; the
resumed run ends where a run that never hung ends. Negative control: loader.timeout=0 still waits."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from {{ cookiecutter.package }}.engine import failures
from tests.helpers import PROJECT, RNG_DATA, last_logged_step, load_ckpt, run_train, same_weights

TIMEOUT_S = 15


def hanging_data(marker) -> list[str]:
    """RNG_DATA whose train sample 37 blocks forever the first time it is read (tests.datasets.HangsOnce)."""
    data = [
        o.replace("RngDrawingDataset", "HangsOnce", 1) if o.startswith("data.train._target_") else o for o in RNG_DATA
    ]
    return [*data, f"+data.train.marker={marker}", "+data.train.hang_index=37", "epochs=2", "log_every_steps=1"]


def start(run_dir, *overrides) -> subprocess.Popen:
    cmd = [sys.executable, "train.py", *overrides, f"hydra.run.dir={run_dir}"]
    # its own process group: the test ends the run and its workers together, a hung worker included
    return subprocess.Popen(
        cmd, cwd=PROJECT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def wait_for(path, timeout_s: float, proc: subprocess.Popen) -> float:
    """Block until `path` exists (the hang began); fail after `timeout_s`. Returns when."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"train.py ended before the hang: {proc.communicate()[1][-2000:]}"
        assert time.monotonic() < deadline, f"the hang did not begin within {timeout_s:g} s"
        time.sleep(0.05)
    return time.monotonic()


@pytest.mark.slow
def test_stalled_worker_is_named_saved_and_resumed_exactly(tmp_path):
    hung, control, straight = tmp_path / "hung", tmp_path / "control", tmp_path / "straight"
    (tmp_path / "straight-marker").touch()  # this one's sample 37 never hangs
    watched = start(hung, *hanging_data(tmp_path / "marker"), f"loader.timeout={TIMEOUT_S}")
    waiting = start(control, *hanging_data(tmp_path / "control-marker"), "loader.timeout=0")
    try:
        began = wait_for(tmp_path / "marker", 120, watched)
        control_began = wait_for(tmp_path / "control-marker", 120, waiting)
        # while both hang: the run that never hangs, to compare with
        run_train(straight, *hanging_data(tmp_path / "straight-marker"))
        _, err = watched.communicate(timeout=TIMEOUT_S + 45)  # a stall that is not caught fails here
        stopped_after = time.monotonic() - began
        # negative control: the same hang with loader.timeout=0, given longer than the watched run needed
        time.sleep(max(0.0, control_began + stopped_after + 5 - time.monotonic()))
        assert waiting.poll() is None, "loader.timeout=0 should still wait on the hung worker"
        control_step = last_logged_step(control)
    finally:
        for proc in (watched, waiting):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
    assert watched.returncode == failures.EXIT_RETRY == 75, err[-3000:]
    assert TIMEOUT_S <= stopped_after < TIMEOUT_S + 30
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: loader.timeout: no batch for 15 s: batch "), err[-3000:]
    holder = re.search(r"made by DataLoader worker \d \(pid (\d+)\)", lines[0])
    assert holder, lines[0]
    stacks = (hung / failures.STALL_STACKS).read_text()
    sections = dict(re.findall(r"--- DataLoader worker pid (\d+) ---\n(.*?)(?=\n--- |\Z)", stacks, re.S))
    assert len(sections) == 2 and "in __getitem__" in sections[holder.group(1)], stacks  # both workers, holder's own
    assert "datasets.py" in sections[holder.group(1)]
    step = load_ckpt(hung / "checkpoints" / "last.pth")["step"]
    assert step == last_logged_step(hung) > 0 and f"checkpoint of step {step} saved" in lines[0]
    assert control_step == last_logged_step(control)  # nothing moved in the control meanwhile

    # restarted (as torchrun or a SLURM requeue would): a fresh worker makes the batch that hung
    run_train(hung, *hanging_data(tmp_path / "marker"), f"loader.timeout={TIMEOUT_S}", "resume=latest",
              f"checkpoint.search_dir={hung}")  # fmt: skip
    resumed = load_ckpt(hung / "checkpoints" / "last.pth")
    assert resumed["step"] == load_ckpt(straight / "checkpoints" / "last.pth")["step"] == 24
    assert same_weights(hung / "checkpoints" / "last.pth", straight / "checkpoints" / "last.pth")
