"""Checkpoint files: how one is written (atomically), and the one safe read of any saved file and its one refusal
(`read`), which `load` holds to this project's checkpoints and `init_weights` (init_from) to a state_dict. Everything
saved is tensors, numbers, strings and containers, so it loads with `torch.load(weights_only=True)`: a checkpoint
cannot run code. What goes into one, and when: run_state.py; resuming: resume.py.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

import torch

{% if cookiecutter.with_fsdp == "yes" %}
from . import fsdp, sharded_checkpoint
{% endif %}
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
