"""Data-parallel training with torchrun (2 ranks, gloo on CPU)."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch

from tests import helpers
from tests.helpers import (
    PROJECT,
    RNG_DATA,
    load_ckpt,
    read_jsonl,
    run_torchrun,
    run_train,
    same_weights,
    wait_for_steps,
)

DATA = [*RNG_DATA, "rng_mode=per_worker", "loader.num_workers=1", "epochs=2"]  # 2 x 100 samples, 6 steps per epoch


def torchrun_cmd(run_dir, *overrides, launcher_args=()):
    return helpers.torchrun_cmd(run_dir, *DATA, *overrides, launcher_args=launcher_args)


def torchrun(run_dir, *overrides, expect=0, timeout=300):
    return run_torchrun(run_dir, *DATA, *overrides, expect=expect, timeout=timeout)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ddp")
    torchrun(run_dir, "log_every_steps=1")
    return run_dir


@pytest.mark.slow
def test_two_ranks_train_and_only_rank0_writes(straight):
    records = read_jsonl(straight / "metrics.jsonl")
    assert [r["epoch"] for r in records] == [0, 1] and records[-1]["step"] == 12
    assert len(read_jsonl(straight / "steps.jsonl")) == 12  # one line per step (log_every_steps=1), not one per rank
    ckpt = load_ckpt(straight / "checkpoints/last.pth")
    assert len(ckpt["ranks"]) == 2
    streams = [r["loader"]["worker_streams"][0]["torch"] for r in ckpt["ranks"]]
    assert not torch.equal(*streams)  # each rank's worker has its own RNG stream, and both are saved


@pytest.mark.slow
def test_interrupted_two_rank_run_resumes_exactly(tmp_path, straight):
    torchrun(tmp_path / "first", "max_steps=4", "log_every_steps=1")
    torchrun(tmp_path / "second", f"resume={tmp_path}/first/checkpoints/last.pth", "log_every_steps=1")
    assert same_weights(straight / "checkpoints/last.pth", tmp_path / "second/checkpoints/last.pth")
    steps = read_jsonl(tmp_path / "first/steps.jsonl") + read_jsonl(tmp_path / "second/steps.jsonl")
    losses = [r["loss"] for r in steps]
    assert losses == [r["loss"] for r in read_jsonl(straight / "steps.jsonl")]


@pytest.mark.slow
def test_two_rank_checkpoint_resumes_on_one_process(tmp_path, straight):
    """A 2-process checkpoint goes on in one process with the global batch (exactness: tests/test_world_size.py)."""
    proc = run_train(tmp_path, *DATA, f"resume={straight}/checkpoints/step-00000006.pth", "log_every_steps=1")
    assert "resuming a 2-process run on 1 processes: global batch 32, 32 per process" in proc.stderr + _text(
        tmp_path / "train.log"
    )
    assert [r["step"] for r in read_jsonl(tmp_path / "steps.jsonl")] == list(range(7, 13))


@pytest.mark.slow
def test_sigterm_to_torchrun_stops_all_ranks_at_one_step(tmp_path, straight):
    """Ranks agree on a stop where they read the loss: every 4 steps here, and at the epoch's end (step 6)."""
    run_dir = tmp_path / "first"
    proc = subprocess.Popen(
        torchrun_cmd(run_dir, "log_every_steps=4"),
        cwd=PROJECT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_for_steps(run_dir, 4)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    ckpt = load_ckpt(run_dir / "checkpoints/last.pth")
    assert ckpt["step"] in (4, 6, 8), out[-2000:]  # a log point: no rank ran a step the other did not
    assert len(ckpt["ranks"]) == 2 and ckpt["ranks"][0]["loader"]["position"] == ckpt["ranks"][1]["loader"]["position"]
    torchrun(tmp_path / "second", f"resume={run_dir}/checkpoints/last.pth")
    assert same_weights(straight / "checkpoints/last.pth", tmp_path / "second/checkpoints/last.pth")


# A stand-in for a job runner's process: it owns USR2 before train.py starts and "requeues" when called.
REQUEUE = """
import pathlib, runpy, signal, sys
marker = pathlib.Path(sys.argv[1])
def requeue(signum, frame):
    marker.write_text(str(signum))
    sys.exit(0)
signal.signal(signal.SIGUSR2, requeue)
sys.argv = ["train.py", *sys.argv[2:]]
runpy.run_path("train.py", run_name="__main__")
"""


@pytest.mark.slow
def test_requeue_path_saves_hands_over_and_resumes_in_the_same_folder(tmp_path):
    reference = tmp_path / "straight"
    run_train(reference, *DATA)
    job_dir, marker = tmp_path / "job", tmp_path / "requeued"
    cmd = [
        sys.executable,
        "-c",
        REQUEUE,
        str(marker),
        *DATA,
        "resume=latest",
        f"checkpoint.search_dir={job_dir}",
        "log_every_steps=1",
        f"hydra.run.dir={job_dir}",
    ]
    proc = subprocess.Popen(cmd, cwd=PROJECT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for_steps(job_dir, 3)
    proc.send_signal(signal.SIGUSR2)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and marker.read_text() == str(int(signal.SIGUSR2)), out[-2000:]
    stopped = load_ckpt(job_dir / "checkpoints/last.pth")["step"]
    # the requeued job: same command, same folder; resume=latest finds the folder's own checkpoint
    run_train(job_dir, *DATA, "resume=latest", f"checkpoint.search_dir={job_dir}", "log_every_steps=1")
    assert read_jsonl(job_dir / "steps.jsonl")[stopped]["step"] == stopped + 1
    assert [r["step"] for r in read_jsonl(job_dir / "steps.jsonl")] == list(range(1, 25))
    assert same_weights(reference / "checkpoints/last.pth", job_dir / "checkpoints/last.pth")


def elastic_cmd(run_dir, *overrides):
    """The command of docs/distributed.md: torchrun restarts failed attempts; each resumes from the folder's
    own last.pth."""
    return torchrun_cmd(
        run_dir,
        "checkpoint.every_steps=2",
        "log_every_steps=1",  # a steps.jsonl line per step: the kill points are exact
        "resume=latest",
        f"checkpoint.search_dir={run_dir}",
        *overrides,
        launcher_args=("--max-restarts=2",),
    )


def rank_pids(agent: subprocess.Popen) -> dict[int, int]:
    """RANK -> PID of the training processes torchrun's agent started (its direct children)."""
    found = {}
    for child in psutil.Process(agent.pid).children():
        try:
            env = child.environ()
        except psutil.Error:
            continue
        if "RANK" in env:
            found[int(env["RANK"])] = child.pid
    return found


@pytest.mark.slow
@pytest.mark.parametrize("victim, after_steps", [(1, 3), (0, 5), (1, 8)])
def test_elastic_restart_after_kill_9_ends_exactly(tmp_path, straight, victim, after_steps):
    """kill -9 of one rank mid-run: torchrun restarts both, they resume from the last checkpoint, and the job ends on
    the uninterrupted run's weights. The survivor answers the agent's SIGTERM without the 30 s SIGKILL fallback."""
    run_dir = tmp_path / "job"
    agent = subprocess.Popen(
        elastic_cmd(run_dir), cwd=PROJECT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    wait_for_steps(run_dir, after_steps)
    assert len(read_jsonl(run_dir / "steps.jsonl")) >= after_steps
    pids = rank_pids(agent)
    assert sorted(pids) == [0, 1], pids
    os.kill(pids[victim], signal.SIGKILL)
    out, _ = agent.communicate(timeout=300)
    assert agent.returncode == 0, out[-4000:]
    assert "attempt 1" in out  # there was a restart
    assert "forcefully exiting" not in out, out[-4000:]  # the agent never had to fall back to SIGKILL
    assert same_weights(straight / "checkpoints/last.pth", run_dir / "checkpoints/last.pth")
    assert [r["step"] for r in read_jsonl(run_dir / "steps.jsonl")] == list(range(1, 13))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The negative control's stand-in for a stop handler that only sets a flag, in place while the rank joins
FLAG_ONLY = "import runpy, signal, sys; signal.signal(signal.SIGTERM, lambda *_: None); sys.argv = sys.argv[1:]; "
FLAG_ONLY += "runpy.run_path('train.py', run_name='__main__')"


@pytest.mark.slow
@pytest.mark.parametrize("handler", ["as shipped", "flag only"])
def test_sigterm_while_joining_exits_at_once(tmp_path, handler):
    """A rank waiting for a peer that never comes (here: rank 1 of 2, no rank 0) exits on SIGTERM at once, having
    written nothing: the ranks join before the run's checks, with SIGTERM's default action (the stop handler that
    saves comes later, in train.py). The negative control (a flag-only handler during the join) shows such a
    handler leaving it blocked: Python runs it only once the join returns."""
    env = {
        **os.environ,
        "WORLD_SIZE": "2",
        "RANK": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    run_dir = tmp_path / "rank1"
    launch = ["-c", FLAG_ONLY] if handler == "flag only" else []
    proc = subprocess.Popen(
        [sys.executable, *launch, "train.py", *DATA, f"hydra.run.dir={run_dir}"],
        cwd=PROJECT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        killer = threading.Timer(120, proc.kill)  # a rank that never says it joins fails the test, not hangs it
        killer.start()
        said = _until_joining(proc.stderr)
        killer.cancel()
        assert "rank 1 of 2: joining the process group (attempt 0)" in said, said
        time.sleep(1.0)  # inside the rendezvous now
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        if handler == "as shipped":
            _, err = proc.communicate(timeout=30)
            assert proc.returncode == -signal.SIGTERM and time.monotonic() - sent < 5, err
            assert not run_dir.exists()  # nothing written: the run folder comes after the checks
        else:
            with pytest.raises(subprocess.TimeoutExpired):
                proc.communicate(timeout=4)  # still blocked: only the agent's SIGKILL would end it
    finally:
        proc.kill()
        proc.communicate()


def _until_joining(stream) -> str:
    """What a process writes to `stream` up to its line saying it joins the process group (or to its end)."""
    said = ""
    for line in iter(stream.readline, ""):
        said += line
        if "joining the process group" in line:
            break
    return said


def _text(path) -> str:
    return path.read_text() if path.exists() else ""
