"""Resuming: find the checkpoint to continue from, check it fits this run, and load it into the live objects.

The file format and its atomic writing are in checkpoint.py.
"""

from __future__ import annotations

import logging
from pathlib import Path

from hydra.utils import to_absolute_path

from . import rng
from .errors import UserError

log = logging.getLogger(__name__)


def rank_state(train_loader) -> dict:
    """What differs between data-parallel processes: each one's main RNG and train loader (its worker streams)."""
    return {"rng": rng.capture_main(), "loader": train_loader.state_dict()}


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
