"""/dev/shm: the loaders' batches held against its free space before any worker starts (adjust or refuse), and a
/dev/shm that fills mid-run named in one line, with the last checkpoint intact.

The end-to-end tests run train.py under a small private /dev/shm: a tmpfs mounted in a mount namespace of its
own (`unshare -m`), so nothing else on the machine sees it. That needs root; elsewhere they are skipped."""

import contextlib
import errno
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from {{ cookiecutter.package }}.engine import failures, memory
from {{ cookiecutter.package }}.engine.errors import UserError
from tests.helpers import PROJECT, RNG_DATA, last_logged_step, load_ckpt, loader_settings, read_jsonl

MiB = 2**20
# RNG_DATA at 32x32: one batch is 16 x 3x32x32 float32 + 16 int64 = 0.19 MiB
BIG = [*RNG_DATA, "+data.train.image_size=32", "+data.val.image_size=32", "epochs=2"]


def private_shm_works() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = "mount -t tmpfs -o size=1m tmpfs /dev/shm && test $(df -k /dev/shm | awk 'NR==2 {print $2}') -eq 1024"
    return subprocess.run(["unshare", "-m", "sh", "-c", probe], capture_output=True).returncode == 0


needs_private_shm = pytest.mark.skipif(
    not private_shm_works(), reason="needs root and `unshare -m` to mount a small private /dev/shm"
)


def in_small_shm(size_mib: float, run_dir, *overrides) -> list[str]:
    """train.py in its own mount namespace, with a tmpfs of `size_mib` on /dev/shm; `exec` keeps its pid."""
    train = " ".join(f"'{a}'" for a in [sys.executable, "train.py", *overrides, f"hydra.run.dir={run_dir}"])
    mount = f"mount -t tmpfs -o size={int(size_mib * 1024)}k tmpfs /dev/shm"
    return ["unshare", "-m", "sh", "-c", f"{mount} && exec {train}"]


def test_fit_to_shm_lowers_prefetch_then_workers_and_refuses_below_one_batch():
    batch = MiB
    roomy = (100 * MiB, 100 * MiB)
    settings = loader_settings(16, 4, prefetch=4)  # 16 in flight + 16 validation + 1 in training = 33 batches
    assert memory.Plan(settings, batch).shm_batches == 33
    assert memory.fit(settings, batch, space=roomy) == (settings, [])  # negative control: room to spare
    assert memory.Plan(settings, batch).shm_need(ranks=2) == int(2 * 33 * MiB * memory.SHM_MARGIN)

    fitted, [note] = memory.fit(settings, batch, space=(30 * MiB, 64 * MiB))  # 2x2 + 2x2 ... 30 / 1.25 = 24 batches
    assert (fitted.num_workers, fitted.prefetch_factor) == (4, 2) and memory.Plan(fitted, batch).shm_need() <= 30 * MiB
    assert note.startswith("/dev/shm has 30.0 MiB free of 64.0 MiB") and "prefetch_factor 4 -> 2" in note

    fitted, [note] = memory.fit(settings, batch, space=(5 * MiB, 64 * MiB))  # 4 batches: 1 worker, 1 ahead
    assert (fitted.num_workers, fitted.prefetch_factor) == (1, 1) and "num_workers 4 -> 1" in note

    with pytest.raises(UserError, match="even one worker with one batch ahead does not fit") as refused:
        memory.fit(settings, batch, space=(3 * MiB, 64 * MiB))
    assert "--shm-size" in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(UserError, match="on_budget=adjust"):
        memory.fit(settings, batch, on_budget="error", space=(30 * MiB, 64 * MiB))
    assert memory.fit(loader_settings(16, 0), batch, space=(0, 64 * MiB))[1] == []  # no workers, no shm


def test_local_ranks_share_one_shm(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert memory.local_ranks() == 4
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "2(x3)")
    assert memory.local_ranks() == 2
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE")
    assert memory.local_ranks() == 1


@needs_private_shm
@pytest.mark.slow
def test_small_shm_adjusts_or_refuses(tmp_path):
    # balanced: 9 batches of 0.19 MiB (4 in flight, 4 of validation, 1 in training) x 1.25 = 2.1 MiB > 2 MiB
    proc = subprocess.run(in_small_shm(2, tmp_path / "adjust", *BIG), cwd=PROJECT, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "loader: /dev/shm has 2.0 MiB free of 2.0 MiB" in out and "prefetch_factor 2 -> 1 (1.2 MiB)" in out, out
    plan = next(line for line in out.splitlines() if "prefetch plan: one batch" in line)
    assert "(2 workers x prefetch_factor 1)" in plan and "MiB free of 2.0 MiB" in plan  # the plan line's figure
    assert [r["epoch"] for r in read_jsonl(tmp_path / "adjust" / "metrics.jsonl")] == [0, 1]

    proc = subprocess.run(in_small_shm(2, tmp_path / "error", *BIG, "loader.on_budget=error"), cwd=PROJECT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("error: loader: /dev/shm has 2.0 MiB free of 2.0 MiB") and "--shm-size" in lines[0]
    assert not (tmp_path / "error" / "checkpoints" / "last.pth").exists()


def keep_full(path, proc: subprocess.Popen) -> None:
    """Keep the file system of `path` full while `proc` runs, as another program writing to /dev/shm would: what the
    run's workers free (a batch taken), it takes, so a worker soon finds no room for its next batch."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        while proc.poll() is None:
            try:
                os.write(fd, b"\0" * 4096)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
                time.sleep(0.001)
    finally:
        os.close(fd)


@needs_private_shm
@pytest.mark.slow
def test_shm_filled_mid_run_ends_in_one_line_with_the_checkpoint_intact(tmp_path):
    data = [o.replace("RngDrawingDataset", "SlowItems", 1) if o.startswith("data.train._target_") else o for o in BIG]
    # 4096 samples, 64 steps an epoch: /dev/shm, kept full from step 4, fails a worker well before the epoch's end,
    # in training, which saves at its step (at an epoch's end the run goes on from its last checkpoint instead)
    cmd = in_small_shm(8, tmp_path, *data, "data.train.size=4096", "+data.train.item_s=0.01", "epochs=4",
                       "log_every_steps=1", "checkpoint.every_steps=2")  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=PROJECT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while last_logged_step(tmp_path) < 4:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "train.py did not reach step 4"
            time.sleep(0.05)
        filler = f"/proc/{proc.pid}/root/dev/shm/filler"  # its /dev/shm, seen through its own mount namespace
        threading.Thread(target=keep_full, args=(filler, proc), daemon=True).start()
        _, err = proc.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    lines = err.strip().splitlines()
    assert proc.returncode == failures.EXIT_RETRY and len(lines) == 1, err[-3000:]
    # the batches in flight are freed by the time the line is written: nearly, not quite, 100%
    assert re.match(r"error: /dev/shm is (9\d|100)% full \([\d.]+ of 8.0 MiB used\)", lines[0]), lines[0]
    step = load_ckpt(tmp_path / "checkpoints" / "last.pth")["step"]  # loads: whole
    assert step == last_logged_step(tmp_path) and f"checkpoint of step {step} saved" in lines[0], lines[0]
    assert step < 4 * 12  # stopped early
