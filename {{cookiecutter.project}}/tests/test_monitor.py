"""Loader health in real runs: the keys in metrics.jsonl, TensorBoard scalars, and a killed worker named, not a hang."""

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from {{ cookiecutter.package }}.engine import failures
from tests.helpers import PROJECT, RNG_DATA, read_jsonl, run_train

HEALTH_KEYS = {"worker_count", "rss_mib", "pss_mib", "fds", "data_wait_share"}


@pytest.mark.parametrize("profile, workers", [("balanced", 2), ("memory-tight", 1)])
@pytest.mark.slow
def test_short_run_logs_health(tmp_path, profile, workers):
    proc = run_train(tmp_path, *RNG_DATA, f"loader={profile}", "epochs=2", "monitor.every_steps=4")
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert len(records) == 2
    for r in records:
        assert HEALTH_KEYS <= r.keys() and {"train_loss", "samples_per_s", "worker_pids"} <= r.keys()
        assert r["worker_count"] == workers == len(r["worker_pids"])
        assert 50 < r["pss_mib"] <= r["rss_mib"] < 64 * 1024  # PSS splits shared pages, RSS counts them in each process
        assert r["fds"] >= 3 * (1 + workers)  # stdin/out/err at least, in the main process and each worker
        assert 0.0 <= r["data_wait_share"] <= 1.0
    out = proc.stdout + proc.stderr
    assert "prefetch plan: one batch 0.05 MiB" in out and "measured at step" in out and "health: " in out
    events = b"".join(p.read_bytes() for p in (tmp_path / "tb").glob("events.out.tfevents.*"))
    for tag in (b"health/pss_mib", b"health/worker_count", b"health/wait_ms_per_step", b"epoch/data_wait_share"):
        assert tag in events


@pytest.mark.slow
def test_zero_workers_report_none(tmp_path):
    run_train(tmp_path, *RNG_DATA, "loader.num_workers=0", "epochs=1")
    (record,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert record["worker_count"] == 0 and record["pss_mib"] > 0


def _exit_with(code):
    os._exit(code)


def test_exit_status_names_signal_and_code():
    ctx = mp.get_context("fork")
    sleeper = ctx.Process(target=time.sleep, args=(60,))
    sleeper.start()
    assert failures.exit_status(sleeper.pid) is None  # still running
    os.kill(sleeper.pid, signal.SIGKILL)
    deadline = time.time() + 10
    while failures.exit_status(sleeper.pid) is None and time.time() < deadline:
        time.sleep(0.01)
    assert failures.exit_status(sleeper.pid) == "killed by signal 9 (SIGKILL)"
    quitter = ctx.Process(target=_exit_with, args=(3,))
    quitter.start()
    while failures.exit_status(quitter.pid) is None and time.time() < deadline:
        time.sleep(0.01)
    assert failures.exit_status(quitter.pid) == "exited with code 3"
    sleeper.join(), quitter.join()
    assert failures.exit_status(quitter.pid) is None  # reaped: a normal end, nothing to report


def test_a_worker_that_ended_as_a_read_failed_is_named():
    """A read of the loader that fails as a worker dies (PyTorch's "exited unexpectedly", or a bare
    ConnectionResetError while it hands over a batch): the worker and its signal while it is not reaped, PyTorch's
    own first line once it is; while every worker runs (the negative control), the error is not taken for a death."""
    sleeper = mp.get_context("fork").Process(target=time.sleep, args=(60,))
    sleeper.start()
    error = ConnectionResetError(104, "Connection reset by peer")
    assert failures.dead_worker({sleeper.pid}, error) is None
    os.kill(sleeper.pid, signal.SIGKILL)
    died = failures.dead_worker({sleeper.pid}, error)
    assert str(died).startswith(f"DataLoader worker (pid {sleeper.pid}) killed by signal 9 (SIGKILL). A SIGKILL")
    assert failures.worker_death(error) == str(died)  # an error anywhere in the loop while a child lies unreaped
    sleeper.join()  # reaped, as PyTorch reaps it before it raises
    assert failures.worker_death(error) is None
    torch_raised = RuntimeError(f"DataLoader worker (pid(s) {sleeper.pid}) exited unexpectedly\nmore")
    assert str(failures.dead_worker({sleeper.pid}, torch_raised)).startswith(
        f"DataLoader worker (pid(s) {sleeper.pid}) exited unexpectedly. A SIGKILL"
    )


@pytest.mark.slow
def test_killed_worker_stops_train_py_with_one_line(tmp_path):
    data = [
        o.replace("RngDrawingDataset", "SlowItems", 1) if o.startswith("data.train._target_") else o for o in RNG_DATA
    ]
    cmd = [
        sys.executable,
        "train.py",
        *data,
        "+data.train.item_s=0.01",
        "data.train.size=2000",
        "epochs=50",
        f"hydra.run.dir={tmp_path}",
    ]
    proc = subprocess.Popen(cmd, cwd=PROJECT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        main = psutil.Process(proc.pid)
        deadline = time.time() + 120
        while not ((tmp_path / "steps.jsonl").exists() and (tmp_path / "steps.jsonl").read_text()):
            assert time.time() < deadline and proc.poll() is None, "the run did not start"
            time.sleep(0.1)
        victim = main.children()[0].pid  # a train loader worker: validation workers start after the first epoch
        os.kill(victim, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)  # a hang fails here
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    lines = err.strip().splitlines()
    # how it ended when the loop's read finds it unreaped, else PyTorch's own line, which names it too
    assert len(lines) == 1 and lines[0].startswith("error: DataLoader worker (pid") and str(victim) in lines[0], err


def test_worker_death_finds_the_line_in_a_chain():
    try:
        try:
            raise failures.WorkerDied("DataLoader worker (pid 4242) killed by signal 9 (SIGKILL)")
        except RuntimeError:
            raise KeyError("cleanup failed on the way out")  # noqa: B904 (the implicit __context__ is the point)
    except KeyError as e:
        line = failures.worker_death(e)
    assert line.startswith("DataLoader worker (pid 4242) killed by signal 9 (SIGKILL). A SIGKILL")
    assert line.endswith("num_workers=0 to see the error in the main process")
    assert failures.worker_death(RuntimeError("DataLoader worker (pid 7) exited unexpectedly")) is None  # not ours
