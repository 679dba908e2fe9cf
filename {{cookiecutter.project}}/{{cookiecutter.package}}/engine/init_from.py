"""`init_from=PATH`: start a run from the weights of another, and nothing else.

Fine-tuning, not resuming: the optimizer, the LR schedule, the step count, the loader position and the RNG
start fresh from this run's config. PATH is a local file: a checkpoint this project wrote (its `model`
weights; `ema` weights are not used), {% if cookiecutter.with_fsdp == "yes" %}a sharded checkpoint's folder (parallel=fsdp), {% endif %}or a plain `state_dict` file
(`torch.save(model.state_dict(), ...)`, or a dict holding one under `state_dict`). It is read with
`weights_only=True`. `init_strict=false` loads what fits (a new head of another size, say) and lists in one line
what it left out.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from . import {% if cookiecutter.with_fsdp == "yes" %}checkpoint, {% endif %}weights_only
from .errors import UserError

log = logging.getLogger(__name__)


def weights_of(path: str) -> dict:
    """The state_dict inside `path`, refused in one line when there is none."""
    if "://" in path:
        raise UserError(f"init_from={path}: only local files are read; download it first and give its path")
    file = Path(path).expanduser()
{% if cookiecutter.with_fsdp == "yes" %}
    if file.is_dir():  # a sharded checkpoint (parallel=fsdp): its shards gathered into whole tensors
        try:
            return checkpoint.full(file)["model"]
        except UserError as e:
            raise UserError(f"init_from={path}: {str(e).removeprefix('resume: ')}") from None
{% endif %}
    if not file.is_file():
        raise UserError(f"init_from={path}: no such file; give the path of a checkpoint or a state_dict file")
    try:
        loaded = weights_only.read(file)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise UserError(f"init_from={path}: not a readable weights file ({type(e).__name__}: {first[:200]})") from None
    for key in ("model", "state_dict"):  # this project's checkpoints; Lightning's and others' state_dict files
        if isinstance(loaded, dict) and isinstance(loaded.get(key), dict):
            loaded = loaded[key]
            break
    if not isinstance(loaded, dict) or not loaded or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise UserError(f"init_from={path}: holds no state_dict (a dict of tensors, or one under 'model')")
    return {k.removeprefix("module."): v for k, v in loaded.items()}  # DDP-wrapped saves name keys module.*


def init_weights(model: torch.nn.Module, path: str, strict: bool, quiet: bool = False) -> None:
    """Load `path`'s weights into `model`; with `strict=False`, only the tensors whose name and shape fit.
    `quiet`: no log line (the config check's dry step loads them too, to refuse a misfit before any work)."""
    saved, own = weights_of(path), model.state_dict()
    missing = [k for k in own if k not in saved]
    unexpected = [k for k in saved if k not in own]
    reshaped = [k for k in own if k in saved and saved[k].shape != own[k].shape]
    if strict and (missing or unexpected or reshaped):
        raise UserError(
            f"init_from={path} does not fit the model: {_listing(missing, unexpected, reshaped)}; "
            "set init_strict=false to load what fits (e.g. a new head)"
        )
    fitting = {k: v for k, v in saved.items() if k in own and k not in reshaped}
    model.load_state_dict(fitting, strict=False)
    left = f"; left as initialised: {_listing(missing, unexpected, reshaped)}" if fitting.keys() != own.keys() else ""
    if quiet:
        return
    log.info(
        "init_from=%s: loaded %d of %d tensors (weights only; a fresh optimizer, schedule and step count: "
        "not a resume)%s",
        path,
        len(fitting),
        len(own),
        left,
    )


def _listing(missing: list, unexpected: list, reshaped: list) -> str:
    def few(names):
        return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")

    parts = [f"{label} {few(names)}" for label, names in
             (("missing", missing), ("unexpected", unexpected), ("other shape", reshaped)) if names]  # fmt: skip
    return "; ".join(parts)
