"""Checkpoint files: what goes into one, how it is written (atomically) and how it is read (safely).

Saved: model, optimizer, LR scheduler, GradScaler, epoch, global step, the run's global progress (global
batches and samples consumed, the global batch: what a resume on another number of processes continues), per rank
the train loader (position in the epoch, its generator, every worker's RNG stream as of the last consumed batch) and
the main process RNG (python, numpy, torch CPU, every CUDA device), the resolved config and library
versions. Everything is tensors, numbers, strings and containers, so it loads with
`torch.load(weights_only=True)`: a checkpoint cannot run code. How a run continues from one is in resume.py.
"""

from __future__ import annotations

import math
import os
import platform
from importlib import metadata
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from . import distributed, rng{% if cookiecutter.with_fsdp == "yes" %}, sharded_checkpoint{% endif +%}
from .errors import UserError
from .weights_only import read

FORMAT = 1
REQUIRED = ("format", "model", "optimizer", "scheduler", "epoch", "step", "ranks", "config")
{% if cookiecutter.with_fsdp == "no" %}
LAST, BEST = "last.pth", "best.pth"  # the names of a run's checkpoints
{% endif %}


def rank_state(train_loader) -> dict:
    """What differs between data-parallel processes: each one's main RNG and train loader (its worker streams)."""
    return {"rng": rng.capture_main(), "loader": train_loader.state_dict()}


def snapshot(cfg, step: int, scheduler, scaler, train_loader, ranks: list[dict]) -> dict:
    """The checkpoint but for the tensors of the model, optimizer and EMA{% if cookiecutter.with_fsdp == "yes" %} (written whole, or sharded){% endif %};
    `ranks` holds `rank_state()` of every process, indexed by rank."""
    return {
        "format": FORMAT,
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict() if scaler.is_enabled() else None,
        "epoch": train_loader.epoch,
        "step": step,
        "progress": train_loader.progress(),
        "ranks": ranks,
        "config": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
        "versions": {
            "torch": str(torch.__version__),
            "torchvision": installed("torchvision"),  # read, not imported: a project without images needs none
            "numpy": str(np.__version__),
            "python": platform.python_version(),
        },
    }


def installed(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


class Checkpointer:
    """Writes `last.pth` plus the newest `keep` files `step-XXXXXXXX.pth` in one folder.

    A save goes to a temp file in the same folder, is fsynced, then renamed over `last.pth`
    (`os.replace` is atomic), so a crash or kill -9 mid-save leaves the previous `last.pth` whole.
    """

    def __init__(self, folder: Path, keep: int):
        self.folder, self.keep = folder, keep
{% if cookiecutter.with_fsdp == "yes" %}
        self.last, self.best = folder / sharded_checkpoint.LAST, folder / sharded_checkpoint.BEST
{% else %}
        self.last, self.best = folder / LAST, folder / BEST
{% endif %}
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob(".tmp-*.pth"):  # left by a save that was killed
            stale.unlink()

    def save(self, state: dict) -> Path:
        tmp = self._write_tmp(state)
        if self.keep > 0:
            kept = self.folder / f"step-{state['step']:08d}.pth"
            kept.unlink(missing_ok=True)
            os.link(tmp, kept)  # same bytes, no second write; survives the rename below
        self._commit(tmp, self.last)
        for old in sorted(self.folder.glob("step-*.pth"))[: -self.keep or None]:
            old.unlink()
        return self.last

    def save_best(self, state: dict) -> Path:
        """`best.pth`, written the same atomic way: a kill mid-save leaves the previous best whole."""
        self._commit(self._write_tmp(state), self.best)
        return self.best

    def _write_tmp(self, state: dict) -> Path:
        tmp = self.folder / f".tmp-{os.getpid()}.pth"
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def _commit(self, tmp: Path, path: Path) -> None:
        os.replace(tmp, path)
{% if cookiecutter.with_fsdp == "yes" %}
        sharded_checkpoint.sync(self.folder)  # make the rename itself durable
{% else %}
        sync(self.folder)  # make the rename itself durable
{% endif %}
{% if cookiecutter.with_fsdp == "no" %}


def sync(folder: Path) -> None:
    """fsync a folder: the files and renames in it are durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
{% endif %}


class Best:
    """Which epoch `best.pth` holds: the best `monitor` value so far, `mode` max or min.

    `monitor` is `train_loss` or any `val_<name>` the task reports. The value travels in every checkpoint under
    `best`, so a resumed run (in any folder) keeps comparing against the best epoch before the stop and never
    overwrites a better best.pth.
    """

    def __init__(self, monitor: str, mode: str, ckpt: dict | None = None):
        self.monitor, self.mode = monitor, mode
        saved = (ckpt or {}).get("best") or {}
        same_rule = saved.get("monitor") == monitor and saved.get("mode") == mode
        self.value: float | None = saved.get("value") if same_rule else None

    def state(self) -> dict:
        return {"monitor": self.monitor, "mode": self.mode, "value": self.value}

    def improves(self, record: dict) -> bool:
        if self.monitor not in record:
            reported = [k for k in record if k == "train_loss" or k.startswith("val_")]
            raise UserError(
                f"checkpoint.monitor={self.monitor} is not reported by the task: pick one of {', '.join(reported)}"
            )
        value = record[self.monitor]
        if math.isnan(value):  # a diverged epoch is never the best, and must not block the ones after it
            return False
        if self.value is None:
            return True
        return value > self.value if self.mode == "max" else value < self.value

    def judge(self, record: dict, state: dict) -> bool:
        """Whether this epoch is the best so far (then its value is kept); `state["best"]` is set either way, so
        last.pth carries the best value too."""
        better = self.improves(record)
        if better:
            self.value = record[self.monitor]
        state["best"] = self.state()
        return better


class CheckpointPolicy:
    """When the run saves, and what: `last.pth` (plus `step-*.pth`) at every epoch end, every `every_steps`
    optimizer steps, at a stop and at `max_steps`; `best.pth` at an epoch end that beats the best so far.

{% if cookiecutter.with_fsdp == "yes" %}
    Every rank hands its RNG and loader state to rank 0. Whole checkpoints: rank 0 alone writes. Sharded ones
    (parallel=fsdp, sharded_checkpoint.py): every rank writes its shards, rank 0 the rest. All ranks wait for the write.
    """

    def __init__(self, folder: Path, keep: int, every_steps: int | None, best: Best, world, step: int = 0,
                 sharded: bool = False):  # fmt: skip
        if sharded:
            self.writer = sharded_checkpoint.ShardedCheckpointer(folder, keep, world)
        else:
            self.writer = Checkpointer(folder, keep) if world.is_main else None
        self.folder, self.every_steps, self.best, self.world = folder, every_steps, best, world
        self.sharded = sharded
{% else %}
    Every rank hands its RNG and loader state to rank 0, which alone writes. All ranks wait for the write.
    """

    def __init__(self, folder: Path, keep: int, every_steps: int | None, best: Best, world, step: int = 0):
        self.writer = Checkpointer(folder, keep) if world.is_main else None
        self.folder, self.every_steps, self.best, self.world = folder, every_steps, best, world
{% endif %}
        self.saved_step = step if step else None  # the step of the newest checkpoint (a resume's, at first)

    def due(self, step: int) -> bool:
        """A save every `every_steps` steps, besides the ones at epoch ends and stops."""
        return bool(self.every_steps) and step % self.every_steps == 0

    def save(self, run, record: dict | None = None) -> None:
        """Save `run` (see engine/run.py); `record`, at an epoch end, is that epoch's metrics.jsonl line."""
        ranks = distributed.gather_to_main(rank_state(run.train_loader), self.world)
        # mid-epoch, the epoch's running sums (a collective): the resumed run logs the same figures
        epoch_done = record is not None and not record.get("mid_epoch")
        meter = None if epoch_done or run.meter is None else run.meter.state(self.world)
        state, better = None, False
        if self.world.is_main:
            state = snapshot(run.cfg, run.step, run.scheduler, run.scaler, run.train_loader, ranks)
            state["best"] = self.best.state()
            state["meter"] = meter
            state["callbacks"] = run.callbacks.state_dict() if run.callbacks is not None else {}
            state["nondeterministic_ops"] = list(run.unexact)  # deterministic=warn: why this run is not bit-exact
{% if cookiecutter.with_tracking == "yes" %}
            state["tracking"] = run.runlog.tracking_ids()  # the MLflow / W&B run a resume continues
{% endif %}
            better = record is not None and self.best.judge(record, state)  # an epoch end: best.pth too when best
{% if cookiecutter.with_fsdp == "yes" %}
        if self.sharded:  # best.pth links to this save, so its epoch's record is inside it
            if state is not None and record is not None:
                state["metrics"] = record
            ema = run.ema.model if run.ema is not None else None
            tensors = sharded_checkpoint.live_state(run.model, run.optimizer, ema)
            self.writer.save(tensors, state, run.step, better)
        elif self.world.is_main:
{% else %}
        if self.world.is_main:
{% endif %}
            state["model"], state["optimizer"] = run.model.state_dict(), run.optimizer.state_dict()
            state["ema"] = run.ema.state_dict() if run.ema is not None else None
            if better:
                self.writer.save_best({**state, "metrics": record})
            self.writer.save(state)
        self.saved_step = run.step
        distributed.barrier(self.world)

    def diverged(self, first_bad: int, step: int) -> str:
        """The one line for a loss that became NaN or inf: nothing is saved past the last good checkpoint."""
        then = (
            f"{self.folder / 'last.pth'} holds step {self.saved_step}, the last good weights: lower optim.lr or set "
            "optim.grad_clip, then resume from it with resume_strict=false"
            if self.saved_step
            else "no checkpoint was written yet: lower optim.lr or set optim.grad_clip and start again"
        )
        return f"the loss became nan or inf at step {first_bad} (seen at step {step}): stopped without saving; {then}"

    @property
    def last(self) -> Path | None:
        """The newest `last.pth` when this process writes checkpoints and one is on disk."""
        if self.writer is None or not self.world.is_main or not self.writer.last.exists():
            return None
        return self.writer.last


def load(path: Path, mmap: bool = False) -> dict:
    """The checkpoint at `path`, or a UserError saying why not. `mmap=True` maps the file instead of reading it: for a
{% if cookiecutter.with_fsdp == "yes" %}
    look at its config and shapes before the run (tensors are read only when touched). A sharded checkpoint (a
    folder) comes without its tensors' values: `model` and `ema` as shapes; resume loads its shards into the run."""
    if path.is_dir():
        return checked(sharded_checkpoint.read_run(path), path)
{% else %}
    look at its config and shapes before the run (tensors are read only when touched)."""
{% endif %}
    if not path.is_file():
        raise UserError(
            f"resume: no checkpoint at {str(path)!r}: give the path of a checkpoints/*.pth file, or resume=latest"
        )
    try:
        ckpt = read(path, mmap=mmap)
    except Exception as e:  # truncated zip, random bytes, a pickle asking for code: all refused the same way
        if mmap:  # torch maps zip archives only: anything else is refused as a plain read refuses it, same message
            return load(path)
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        # torch's weights_only refusal is a page of advice; the line naming the refused global is the one that matters
        reason = next((line for line in lines if "WeightsUnpickler error" in line), lines[0] if lines else "")[:200]
        raise UserError(
            f"resume: {str(path)!r} is not a readable checkpoint ({type(e).__name__}: {reason}); "
            "it is truncated, corrupt or not from this project: pick another, e.g. an older checkpoints/step-*.pth"
        ) from None
    return checked(ckpt, path)


{% if cookiecutter.with_fsdp == "yes" %}
def full(path: Path) -> dict:
    """The checkpoint at `path` with its model (and EMA) weights whole, sharded or not: what eval.py, init_from and
    export read."""
    return checked(sharded_checkpoint.read_full(path), path) if path.is_dir() else load(path)


def is_sharded(ckpt: dict) -> bool:
    """A sharded checkpoint's `load`: its tensors are still on disk (`model` holds shapes only)."""
    return bool(ckpt.get("sharded"))


{% endif %}
def checked(ckpt, path: Path) -> dict:
    """`ckpt` when it has this project's keys and format, else a UserError."""
{% if cookiecutter.with_fsdp == "yes" %}
    required = [k for k in REQUIRED if k != "optimizer"] if path.is_dir() else REQUIRED
    missing = [k for k in required if not isinstance(ckpt, dict) or k not in ckpt]
{% else %}
    missing = [k for k in REQUIRED if not isinstance(ckpt, dict) or k not in ckpt]
{% endif %}
    if missing:
        raise UserError(f"resume: {str(path)!r} is not a checkpoint of this project (missing {', '.join(missing)})")
    if ckpt["format"] != FORMAT:
        raise UserError(f"resume: {str(path)!r} has checkpoint format {ckpt['format']}, this code reads {FORMAT}")
    return ckpt
