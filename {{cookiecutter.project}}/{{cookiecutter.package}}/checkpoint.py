"""Checkpoint files: what goes into one, how it is written (atomically) and how it is read (safely).

Saved: model, optimizer, LR scheduler, GradScaler, epoch, global step, per rank the train loader
(position in the epoch, its generator, every worker's RNG stream as of the last consumed batch) and
the main process RNG (python, numpy, torch CPU, every CUDA device), the resolved config and library
versions. Everything is tensors, numbers, strings and containers, so it loads with
`torch.load(weights_only=True)`: a checkpoint cannot run code. How a run continues from one is in resume.py.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import numpy as np
import torch
import torchvision
from omegaconf import OmegaConf

from .errors import UserError

FORMAT = 1
REQUIRED = ("format", "model", "optimizer", "scheduler", "epoch", "step", "ranks", "config")


def snapshot(cfg, step: int, model, optimizer, scheduler, scaler, train_loader, ranks: list[dict]) -> dict:
    """The whole checkpoint; `ranks` holds `rank_state()` of every process, indexed by rank."""
    return {
        "format": FORMAT,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict() if scaler.is_enabled() else None,
        "epoch": train_loader.epoch,
        "step": step,
        "ranks": ranks,
        "config": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
        "versions": {"torch": str(torch.__version__), "torchvision": str(torchvision.__version__),
                     "numpy": str(np.__version__), "python": platform.python_version()},
    }


class Checkpointer:
    """Writes `last.pth` plus the newest `keep` files `step-XXXXXXXX.pth` in one folder.

    A save goes to a temp file in the same folder, is fsynced, then renamed over `last.pth`
    (`os.replace` is atomic), so a crash or kill -9 mid-save leaves the previous `last.pth` whole.
    """

    def __init__(self, folder: Path, keep: int):
        self.folder, self.keep = folder, keep
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob(".tmp-*.pth"):  # left by a save that was killed
            stale.unlink()

    @property
    def last(self) -> Path:
        return self.folder / "last.pth"

    def save(self, state: dict) -> Path:
        tmp = self.folder / f".tmp-{os.getpid()}.pth"
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        if self.keep > 0:
            kept = self.folder / f"step-{state['step']:08d}.pth"
            kept.unlink(missing_ok=True)
            os.link(tmp, kept)  # same bytes, no second write; survives the rename below
        os.replace(tmp, self.last)
        directory = os.open(self.folder, os.O_RDONLY)
        try:
            os.fsync(directory)  # make the rename itself durable
        finally:
            os.close(directory)
        for old in sorted(self.folder.glob("step-*.pth"))[: -self.keep or None]:
            old.unlink()
        return self.last


def load(path: Path) -> dict:
    if not path.is_file():
        raise UserError(f"resume: no checkpoint at {str(path)!r}: give the path of a checkpoints/*.pth file, "
                        "or resume=latest")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, random bytes, a pickle asking for code: all refused the same way
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        # torch's weights_only refusal is a page of advice; the line naming the refused global is the one that matters
        reason = next((line for line in lines if "WeightsUnpickler error" in line), lines[0] if lines else "")[:200]
        raise UserError(
            f"resume: {str(path)!r} is not a readable checkpoint ({type(e).__name__}: {reason}); "
            "it is truncated, corrupt or not from this project: pick another, e.g. an older checkpoints/step-*.pth"
        ) from None
    missing = [k for k in REQUIRED if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise UserError(f"resume: {str(path)!r} is not a checkpoint of this project (missing {', '.join(missing)})")
    if ckpt["format"] != FORMAT:
        raise UserError(f"resume: {str(path)!r} has checkpoint format {ckpt['format']}, this code reads {FORMAT}")
    return ckpt
