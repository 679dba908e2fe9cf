"""Checkpoint files (checkpoint.py): a save is atomic, even when killed mid-write, and loading refuses anything else."""

import os
import pickle
import threading
import warnings

import pytest
import torch

from {{ cookiecutter.package }}.engine.checkpoint import Checkpointer, load
from {{ cookiecutter.package }}.engine.errors import UserError
from tests.helpers import NOT_A_PICKLE, PROJECT, kill_mid_write

BLOB = 4_000_000  # floats: 16 MB, far more than a pipe holds


def state(step: int) -> dict:
    return {
        "format": 1,
        "model": {"w": torch.full((BLOB,), float(step))},
        "optimizer": {},
        "scheduler": {},
        "epoch": 0,
        "step": step,
        "ranks": [],
        "config": {},
    }


def test_save_keeps_the_newest_and_loads(tmp_path):
    saver = Checkpointer(tmp_path, keep=2)
    for step in (1, 2, 3):
        saver.save(state(step))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pth", "step-00000002.pth", "step-00000003.pth"]
    assert load(tmp_path / "last.pth")["step"] == 3 and load(tmp_path / "step-00000002.pth")["step"] == 2


def test_a_failed_save_leaves_the_previous_file(tmp_path):
    saver = Checkpointer(tmp_path, keep=0)
    saver.save(state(1))
    broken = {**state(2), "extra": threading.Lock()}  # cannot be pickled: torch.save fails part-way
    with pytest.raises(TypeError, match="pickle"):
        saver.save(broken)
    assert load(tmp_path / "last.pth")["step"] == 1
    Checkpointer(tmp_path, keep=0)  # the next run clears what the failed save left
    assert [p.name for p in tmp_path.iterdir()] == ["last.pth"]


# Saves step 1, then saves step 2 into a FIFO planted where the temp file goes: the write blocks once the pipe is
# full, so the test decides exactly when the kill lands: inside torch.save, with part of the file written.
SAVER = """
import os, sys, torch
from pathlib import Path
from tests.test_checkpoint import state
from {{ cookiecutter.package }}.engine.checkpoint import Checkpointer
saver = Checkpointer(Path(sys.argv[1]), keep=1)
saver.save(state(1))
os.mkfifo(saver.folder / f".tmp-{os.getpid()}.pth")
print("saved", flush=True)
saver.save(state(2))
"""


def test_kill_9_mid_write_leaves_last_whole(tmp_path):
    head = kill_mid_write(SAVER, tmp_path, lambda pid: tmp_path / f".tmp-{pid}.pth", 1 << 20)
    whole = (tmp_path / "last.pth").stat().st_size
    assert head.startswith(b"PK") and len(head) == 1 << 20 < whole  # step 2 was partly written when it was killed
    saved = load(tmp_path / "last.pth")
    assert saved["step"] == 1 and torch.equal(saved["model"]["w"], torch.full((BLOB,), 1.0))
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["last.pth", "step-00000001.pth"]
    Checkpointer(tmp_path, keep=1)
    assert not list(tmp_path.glob(".tmp-*"))


def test_a_refused_read_gives_no_warning(tmp_path):
    (tmp_path / "odd.pth").write_bytes(NOT_A_PICKLE)
    with warnings.catch_warnings(record=True) as raw:  # the control: torch itself warns on these bytes
        warnings.simplefilter("always")
        with pytest.raises(pickle.UnpicklingError):
            torch.load(tmp_path / "odd.pth", weights_only=True)
    assert any("pickle protocol" in str(w.message) for w in raw)
    with warnings.catch_warnings(record=True) as held:
        warnings.simplefilter("always")
        with pytest.raises(UserError, match="not a readable checkpoint"):
            load(tmp_path / "odd.pth")
    assert held == []


class Exploit:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_load_refuses_garbage_in_one_line(tmp_path):
    Checkpointer(tmp_path, keep=0).save(state(1))
    data = (tmp_path / "last.pth").read_bytes()
    (tmp_path / "truncated.pth").write_bytes(data[: len(data) // 2])
    (tmp_path / "random.pth").write_bytes(os.urandom(4096))
    (tmp_path / "odd.pth").write_bytes(NOT_A_PICKLE)
    torch.save({"model": Exploit()}, tmp_path / "malicious.pth")
    torch.save({"hello": 1}, tmp_path / "foreign.pth")
    torch.save({**state(1), "format": 99}, tmp_path / "future.pth")
    cases = {
        "missing.pth": "no checkpoint at",
        "truncated.pth": "not a readable checkpoint",
        "random.pth": "not a readable checkpoint",
        "odd.pth": "not a readable checkpoint",
        "malicious.pth": "not a readable checkpoint",
        "foreign.pth": "not a checkpoint of this project (missing format, model",
        "future.pth": "format 99, this code reads 1",
    }
    for name, message in cases.items():
        with pytest.raises(UserError, match="resume: ") as refused:
            load(tmp_path / name)
        assert message in str(refused.value) and "\n" not in str(refused.value), name
    assert not (tmp_path / "pwned").exists() and not (PROJECT / "pwned").exists()


# What a checkpoint of train.py holds: the run's named parts (engine/run_state.py), each saved by itself, and what
# describes the save; a key added or gone changes what eval.py, export and a resume read.
PARTS = ["model", "optimizer", "ema", "scheduler", "scaler", "step", "best", "callbacks", "meter",{% if cookiecutter.with_tracking == "yes" %} "tracking",{% endif %} "ranks"]
DESCRIPTION = {"format", "epoch", "progress", "config", "versions", "nondeterministic_ops", "nondeterministic_data"}


def test_a_checkpoint_is_the_runs_named_parts_and_its_description(shapes_run):
    ckpt = load(shapes_run / "checkpoints" / "last.pth")
    assert list(ckpt) == PARTS + [k for k in ckpt if k in DESCRIPTION] and ckpt.keys() - set(PARTS) == DESCRIPTION
    # an epoch's end: its sums are in metrics.jsonl, nothing to carry; one process: one rank's loader and RNG
    assert ckpt["meter"] is None and ckpt["ema"] is None and len(ckpt["ranks"]) == 1
    assert ckpt["step"] == 10 and ckpt["best"]["value"] is not None
