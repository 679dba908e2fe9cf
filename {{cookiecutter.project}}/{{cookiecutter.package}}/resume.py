"""Checkpoints: what a resumed run needs to be the same run, written atomically, read safely.

Saved: model, optimizer, LR scheduler, GradScaler, epoch, global step, the train loader
(position in the epoch, its generator, every worker's RNG stream as of the last consumed batch),
the main process RNG (python, numpy, torch CPU, every CUDA device), the resolved config and
library versions. Everything is tensors, numbers, strings and containers, so it loads with
`torch.load(weights_only=True)`: a checkpoint cannot run code.
"""

from __future__ import annotations

import logging
import os
import platform
from pathlib import Path

import numpy as np
import torch
import torchvision
from hydra.utils import to_absolute_path
from omegaconf import OmegaConf

from . import rng
from .errors import UserError

log = logging.getLogger(__name__)
FORMAT = 1
REQUIRED = ("format", "model", "optimizer", "scheduler", "epoch", "step", "ranks", "config")


def rank_state(train_loader) -> dict:
    """What differs between data-parallel processes: each one's main RNG and train loader (its worker streams)."""
    return {"rng": rng.capture_main(), "loader": train_loader.state_dict()}


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


def locate(value: str, run_dir: Path, search_dir: str) -> Path | None:
    """`resume=latest`: this run folder's own last.pth (a requeued job), else the newest under `search_dir`,
    else None: a first job submitted with resume=latest starts fresh. Any other value is a path,
    relative to where the command was run."""
    if value != "latest":
        return Path(to_absolute_path(value))
    own = run_dir / "checkpoints" / "last.pth"
    if own.is_file():
        return own
    root = Path(to_absolute_path(search_dir))
    found = sorted(root.glob("**/checkpoints/last.pth"), key=lambda p: p.stat().st_mtime)
    if not found:
        log.warning("resume=latest: no checkpoints/last.pth under %s yet; starting fresh", root)
        return None
    return found[-1]


def load(path: Path) -> dict:
    if not path.is_file():
        raise UserError(f"resume: no checkpoint at {str(path)!r}: give the path of a checkpoints/*.pth file, or resume=latest")
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


def check_fits(ckpt: dict, cfg, model, world_size: int) -> None:
    """Refuse a checkpoint from another model, head size, optimizer or world size, saying what differs."""
    saved_cfg = ckpt["config"]
    for group in ("model", "optim"):
        before, now = saved_cfg[group].get("_target_"), cfg[group].get("_target_")
        if before != now:
            raise UserError(f"resume: the checkpoint was trained with {group} {before}, this run builds {now}: resume with the same {group}")
    saved, current = ckpt["model"], model.state_dict()
    if saved.keys() != current.keys():
        odd = sorted(saved.keys() ^ current.keys())
        raise UserError(f"resume: the model's parameters differ from the checkpoint's ({len(odd)} names, e.g. {odd[0]}): resume with the same model config")
    for name, tensor in current.items():
        if saved[name].shape != tensor.shape:
            raise UserError(
                f"resume: {name} is {tuple(saved[name].shape)} in the checkpoint but {tuple(tensor.shape)} here "
                f"(data.num_classes {saved_cfg['data'].get('num_classes')} there, {cfg.data.num_classes} here): resume with the same model and data"
            )
    if len(ckpt["ranks"]) != world_size and cfg.resume_strict:
        raise UserError(
            f"resume: the checkpoint was written by {len(ckpt['ranks'])} processes, this run has {world_size}: "
            "use the same number, or resume_strict=false to go on without exactness"
        )


def restore(ckpt: dict, cfg, model, optimizer, scheduler, scaler, train_loader, rank: int = 0) -> int:
    """Load everything into the live objects; the main RNG last, just before the loop. Returns the global step."""
    check_fits(ckpt, cfg, model, train_loader.sampler.world_size)
    mine = ckpt["ranks"][rank % len(ckpt["ranks"])]  # another world size only gets here with resume_strict=false
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    scheduler.load_state_dict(ckpt["scheduler"])
    if scaler.is_enabled() and ckpt["scaler"] is not None:
        scaler.load_state_dict(ckpt["scaler"])
    train_loader.load_state_dict(mine["loader"], strict=cfg.resume_strict)
    rng.restore_main(mine["rng"])
    return ckpt["step"]
