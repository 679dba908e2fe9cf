"""Shared helpers: run `train.py` for real (Hydra, DataLoader workers, files on disk) in a subprocess."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

PROJECT = Path(__file__).resolve().parents[1]

# A dataset drawing from the workers' torch, numpy and python RNGs, plugged in like a user's own.
RNG_DATA = [
    "data.train._target_=tests.datasets.RngDrawingDataset",
    "~data.train.root", "~data.train.split", "~data.train.per_class", "~data.train.image_size", "~data.train.transform",
    "+data.train.size=200",
    "data.val._target_=tests.datasets.RngDrawingDataset",
    "~data.val.root", "~data.val.split", "~data.val.per_class", "~data.val.image_size", "~data.val.transform",
    "+data.val.size=64",
    "data.num_classes=4",
    "loader.batch_size=16",
    "progress=false",
]


def run_train(run_dir: Path, *overrides: str, expect: int = 0, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python train.py ...` in the project root, its outputs in `run_dir`; asserts the exit code."""
    cmd = [sys.executable, "train.py", *overrides, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=PROJECT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == expect, f"exit {proc.returncode} != {expect} for {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def wait_for_steps(run_dir: Path, count: int, timeout: float = 120) -> None:
    """Block until a running train.py has logged `count` optimizer steps (steps.jsonl), or `timeout` passed."""
    steps, deadline = run_dir / "steps.jsonl", time.time() + timeout
    while not (steps.exists() and steps.read_text().count("\n") >= count) and time.time() < deadline:
        time.sleep(0.01)


def load_ckpt(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


@pytest.fixture(scope="session")
def shapes_root(tmp_path_factory) -> Path:
    """A small shapes folder shared by the tests that train on real image files."""
    return tmp_path_factory.mktemp("data") / "shapes"


@pytest.fixture
def shapes(shapes_root) -> list[str]:
    return [f"data.root={shapes_root}", "data.per_class=40", "epochs=2", "loader.batch_size=32", "progress=false"]
