"""Checkpoint files: what goes into one (`CheckpointPolicy.save`), how it is written (atomically), and the one safe
read of any saved file and its one refusal (`read`), which `load` holds to this project's checkpoints and
`init_weights` (init_from) to a state_dict. Everything saved is tensors, numbers, strings and containers, so it loads
with `torch.load(weights_only=True)`: a checkpoint cannot run code. Resuming: resume.py.
"""

from __future__ import annotations

import logging
import math
import os
import platform
import warnings
from importlib import metadata
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from . import distributed, {% if cookiecutter.with_fsdp == "yes" %}fsdp, {% endif %}rng{% if cookiecutter.with_fsdp == "yes" %}, sharded_checkpoint{% endif +%}
from .errors import UserError, reason
from .files import durable
{% if cookiecutter.with_fsdp == "yes" %}
from .sharded_checkpoint import BEST, LAST
{% endif %}

log = logging.getLogger(__name__)
FORMAT = 1
REQUIRED = ("format", "model", "optimizer", "scheduler", "epoch", "step", "ranks", "config")
{% if cookiecutter.with_fsdp == "no" %}
LAST, BEST = "last.pth", "best.pth"  # the names of a run's checkpoints
{% endif %}


class Checkpointer:
    """Writes `last.pth`, the newest `keep` files `step-XXXXXXXX.pth` and `best.pth` in one folder, atomically
    (`publish`): a kill mid-save leaves the previous files whole."""

    def __init__(self, folder: Path, keep: int):
        self.folder, self.keep = folder, keep
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob(".tmp-*.pth"):  # left by a save that was killed
            stale.unlink()

    def save(self, state: dict, best: dict | None = None) -> None:
        """`best`: the metrics.jsonl line of an epoch that is the best so far, then in `best.pth` too (`metrics`)."""
        if best is not None:
            publish({**state, "metrics": best}, self.folder / BEST)
        publish(state, self.folder / LAST, self.folder / f"step-{state['step']:08d}.pth" if self.keep > 0 else None)
        for old in sorted(self.folder.glob("step-*.pth"))[: -self.keep or None]:
            old.unlink()


def publish(state: dict, path: Path, also: Path | None = None) -> None:
    """Write `state` to `path` durably (files.py): a kill -9 mid-save leaves the previous file whole. `also`: the same
    bytes under a second name (a hard link)."""
    with durable(path, path.parent / f".tmp-{os.getpid()}.pth") as f:
        torch.save(state, f)
    if also is not None:
        also.unlink(missing_ok=True)
        os.link(path, also)


class Best:
    """Which epoch `best.pth` holds: the best `monitor` value so far (`train_loss` or a `val_<name>`), `mode` max or
    min. The value travels in every checkpoint (`best`), so a resumed run, in any folder, never overwrites a better
    best.pth."""

    def __init__(self, monitor: str, mode: str, ckpt: dict | None = None):
        self.monitor, self.mode = monitor, mode
        saved = (ckpt or {}).get("best") or {}
        same_rule = saved.get("monitor") == monitor and saved.get("mode") == mode
        self.value: float | None = saved.get("value") if same_rule else None

    def state(self) -> dict:
        return {"monitor": self.monitor, "mode": self.mode, "value": self.value}

    def judge(self, record: dict) -> bool:
        """Whether this epoch is the best so far, then kept (the dry step refused a `monitor` the task does not
        report). A NaN, a diverged epoch, is never the best, and must not block the ones after it."""
        value = record[self.monitor]
        better = not math.isnan(value) and (
            self.value is None or (value > self.value if self.mode == "max" else value < self.value)
        )
        if better:
            self.value = value
        return better


class CheckpointPolicy:
    """When the run saves, and what: `last.pth` (plus `step-*.pth`) at every epoch end, every `every_steps`
    optimizer steps, at a stop and at `max_steps`; `best.pth` at an epoch end that beats the best so far. Every rank
    hands its RNG and loader state to rank 0, which alone writes{% if cookiecutter.with_fsdp == "yes" %} (parallel=fsdp: all but each rank's own shards,
    sharded_checkpoint.py){% endif %}; all ranks wait for the write."""

{% if cookiecutter.with_fsdp == "yes" %}
    def __init__(self, folder: Path, cfg, world, ckpt: dict | None = None, sharded: bool = False):
        whole = Checkpointer(folder, cfg.keep) if world.is_main and not sharded else None
        self.writer = sharded_checkpoint.ShardedCheckpointer(folder, cfg.keep, world) if sharded else whole
        self.sharded = sharded
{% else %}
    def __init__(self, folder: Path, cfg, world, ckpt: dict | None = None):
        self.writer = Checkpointer(folder, cfg.keep) if world.is_main else None
{% endif %}
        self.folder, self.every_steps, self.world = folder, cfg.every_steps, world  # cfg: the run's `checkpoint`
        self.best = Best(cfg.monitor, cfg.mode.value, ckpt)  # the best epoch so far, the resumed run's included
        self.saved_step = ckpt["step"] if ckpt else None  # the step of the newest checkpoint (a resume's, at first)

    def due(self, step: int) -> bool:
        """A save every `every_steps` steps, besides the ones at epoch ends and stops."""
        return bool(self.every_steps) and step % self.every_steps == 0

    def save(self, run, record: dict | None = None) -> None:
        """Save `run` (see engine/run.py); `record`, at an epoch end, is that epoch's metrics.jsonl line. `ranks`:
        what differs between data-parallel processes, each one's main RNG and train loader (its worker streams)."""
        mine = {"rng": rng.capture_main(), "loader": run.train_loader.state_dict()}
        ranks = distributed.gather_all(mine, self.world)
        # mid-epoch, the epoch's running sums (a collective): the resumed run logs the same figures
        epoch_done = record is not None and not record.get("mid_epoch")
        meter = None if epoch_done or run.meter is None else run.meter.state(self.world)
{% if cookiecutter.with_fsdp == "yes" %}
        state, better = None, False  # every rank takes part in a sharded save
{% endif %}
        if self.world.is_main:
            better = record is not None and self.best.judge(record)  # an epoch end: best.pth too when best
            state = {  # all but the model's, optimizer's and EMA's tensors{% if cookiecutter.with_fsdp == "yes" %} (written whole, or sharded){% endif %}, added below
                "format": FORMAT,
                "scheduler": run.scheduler.state_dict(),
                "scaler": run.scaler.state_dict() if run.scaler.is_enabled() else None,
                "epoch": run.train_loader.epoch,
                "step": run.step,
                "progress": run.train_loader.progress(),
                "ranks": ranks,
                "config": OmegaConf.to_container(run.cfg, resolve=True, enum_to_str=True),
                "versions": {
                    "torch": str(torch.__version__),
                    # read, not imported: a project without images needs none
                    "torchvision": next((d.version for d in metadata.distributions(name="torchvision")), None),
                    "numpy": str(np.__version__),
                    "python": platform.python_version(),
                },
                "best": self.best.state(),
                "meter": meter,
                "callbacks": run.callbacks.state_dict(),
                "nondeterministic_ops": list(run.unexact),  # deterministic=warn: why this run is not bit-exact
            }
{% if cookiecutter.with_tracking == "yes" %}
            trackers = run.runlog.tracking  # the MLflow / W&B runs a resume continues
            state["tracking"] = {t.name: t.run_id for t in trackers.trackers} if trackers is not None else {}
{% endif %}
{% if cookiecutter.with_fsdp == "yes" %}
        if self.sharded:  # best.pth links to this save, so its epoch's record is inside it
            if state is not None and record is not None:
                state["metrics"] = record
            ema = run.ema.model if run.ema is not None else None
            tensors = sharded_checkpoint.live_state(run.model, run.optimizer, ema)
            self.writer.save(tensors, state, run.step, better)
        elif self.world.is_main:
{% endif %}
            state["model"], state["optimizer"] = run.model.state_dict(), run.optimizer.state_dict()
            state["ema"] = run.ema.model.state_dict() if run.ema is not None else None
            self.writer.save(state, record if better else None)
        self.saved_step = run.step
        distributed.gather_all(None, self.world)  # a barrier: no rank goes on before the save is on disk

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
        """The newest `last.pth` on rank 0, once one is on disk."""
        last = self.folder / LAST
        return last if self.world.is_main and last.exists() else None


{% if cookiecutter.with_fsdp == "yes" %}
def read(path: Path, who: str, wanted: str, mmap: bool = False, whole: bool = False):
{% else %}
def read(path: Path, who: str, wanted: str, mmap: bool = False):
{% endif %}
    """What the file at `path` holds, read with `torch.load(weights_only=True)`, or one UserError `<who>: ...` saying
    why not (`wanted`: what to give instead of a path with nothing there). `mmap=True`: tensors read only when
    touched.{% if cookiecutter.with_fsdp == "yes" %} A sharded save's folder: its run.pth, with `model` and `ema` as shapes or, `whole`, gathered
    into whole tensors (sharded_checkpoint.py).{% endif +%}
    torch's warnings are held back until the read succeeds: on bytes that are no checkpoint it warns of a pickle
    protocol first, and the one refusal line says all there is to say."""
    if not path.exists():
        raise UserError(f"{who}: no checkpoint at {str(path)!r}: give the path of {wanted}")
    try:
        with warnings.catch_warnings(record=True) as held:
            warnings.simplefilter("always")
{% if cookiecutter.with_fsdp == "yes" %}
            found = path / sharded_checkpoint.RUN_FILE if path.is_dir() else path
            loaded = torch.load(found, map_location="cpu", weights_only=True, mmap=mmap)
            if path.is_dir():
                loaded = {**loaded, **sharded_checkpoint.tensors(path, whole)}
{% else %}
            loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
{% endif %}
    except Exception as e:  # truncated zip, random bytes, a pickle asking for code: all refused the same way
        if mmap:  # torch maps zip archives only: anything else is refused as a plain read refuses it, same message
            return read(path, who, wanted)
        raise UserError(
{% if cookiecutter.with_fsdp == "yes" %}
            f"{who}: {str(path)!r} is not a readable {'sharded ' * path.is_dir()}checkpoint ({reason(e)}"
{% else %}
            f"{who}: {str(path)!r} is not a readable checkpoint ({reason(e)}"
{% endif %}
            "); it is truncated, corrupt or not from this project: pick another, e.g. an older "
            "checkpoints/step-*.pth"
        ) from None
    for w in held:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    return loaded


{% if cookiecutter.with_fsdp == "yes" %}
def load(path: Path, mmap: bool = False, whole: bool = False, who: str = "resume", latest: str = "resume") -> dict:
{% else %}
def load(path: Path, mmap: bool = False, who: str = "resume", latest: str = "resume") -> dict:
{% endif %}
    """The checkpoint of this project at `path` (`read`), or a UserError saying why not. `latest`: the key that would
    find one instead (resume=latest, ckpt=latest)."""
    wanted = "a checkpoints/*.pth file" + (f", or {latest}=latest" if latest else "")
    ckpt = read(path, who, wanted, mmap{% if cookiecutter.with_fsdp == "yes" %}, whole{% endif %})
{% if cookiecutter.with_fsdp == "yes" %}
    required = REQUIRED if path.is_file() else [k for k in REQUIRED if k != "optimizer"]  # a sharded save's: in shards
    missing = [k for k in required if not isinstance(ckpt, dict) or k not in ckpt]
{% else %}
    missing = [k for k in REQUIRED if not isinstance(ckpt, dict) or k not in ckpt]
{% endif %}
    if missing:
        raise UserError(f"{who}: {str(path)!r} is not a checkpoint of this project (missing {', '.join(missing)})")
    if ckpt["format"] != FORMAT:
        raise UserError(f"{who}: {str(path)!r} has checkpoint format {ckpt['format']}, this code reads {FORMAT}")
    return ckpt


def misfit(own: dict, saved: dict) -> str:
    """Why the tensors `saved` do not load into a model whose state_dict is `own`, in one line: its missing,
    unexpected and reshaped names, four of each at most; "" when they fit."""
    odd = {"missing": [k for k in own if k not in saved], "unexpected": [k for k in saved if k not in own],
           "other shape": [k for k in own if k in saved and saved[k].shape != own[k].shape]}  # fmt: skip
    return "; ".join(f"{label} {', '.join(names[:4])}" + (f" and {len(names) - 4} more" if len(names) > 4 else "")
                     for label, names in odd.items() if names)  # fmt: skip


def init_weights(model: torch.nn.Module, path: str, strict: bool) -> None:
    """`init_from=PATH`: the weights in `path` and nothing else (fine-tuning, not resuming: optimizer, schedule, step,
    loader and RNG start fresh). PATH is a local checkpoint of this project (its `model`, not `ema`) or a `state_dict`
    file (or a dict with one under `state_dict`), memory-mapped. With `strict=False` (init_strict=false), only the
    tensors whose name and shape fit, and a line listing the rest.{% if cookiecutter.with_fsdp == "yes" %} A sharded model (parallel=fsdp) takes them
    through fsdp.fill, no rank reading them whole; any other gathers a sharded checkpoint whole.{% endif %}"""
    who = f"init_from={path}"
    if "://" in path:
        raise UserError(f"{who}: only local files are read; download it first and give its path")
{% if cookiecutter.with_fsdp == "yes" %}
    local, sharded = Path(path).expanduser(), fsdp.is_sharded(model)
    saved = read(local, who, "a checkpoint or a state_dict file", mmap=True, whole=not sharded)
{% else %}
    saved = read(Path(path).expanduser(), who, "a checkpoint or a state_dict file", mmap=True)
{% endif %}
    for key in ("model", "state_dict"):  # this project's checkpoints; Lightning's and others' state_dict files
        if isinstance(saved, dict) and isinstance(saved.get(key), dict):
            saved = saved[key]
            break
    if not isinstance(saved, dict) or not saved or not all(isinstance(v, torch.Tensor) for v in saved.values()):
        raise UserError(f"{who}: holds no state_dict (a dict of tensors, or one under 'model')")
    saved = {k.removeprefix("module."): v for k, v in saved.items()}  # DDP-wrapped saves name keys module.*
    own = model.state_dict()
    listing = misfit(own, saved)
    if strict and listing:
        raise UserError(f"{who} does not fit the model: {listing}; set init_strict=false to load what fits "
                        "(e.g. a new head)")  # fmt: skip
    fitting = {k: v for k, v in saved.items() if k in own and v.shape == own[k].shape}
{% if cookiecutter.with_fsdp == "yes" %}
    if sharded:
        fsdp.fill(model, local, fitting)
    else:
        model.load_state_dict(fitting, strict=False)
{% else %}
    model.load_state_dict(fitting, strict=False)
{% endif %}
    left = f"; left as initialised: {listing}" if fitting.keys() != own.keys() else ""
    log.info("init_from=%s: loaded %d of %d tensors (weights only; a fresh optimizer, schedule and step count: "
             "not a resume)%s", path, len(fitting), len(own), left)  # fmt: skip
