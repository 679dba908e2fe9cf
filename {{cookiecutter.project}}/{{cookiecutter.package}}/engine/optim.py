"""The optimizer from `conf/optim/`, and the knobs the loop applies around it.

`conf/optim/*.yaml` names any optimizer class (`_partial_: true`; the parameters come from here). Its keys
`grad_clip`, `decay_norm_and_bias` and `param_groups` (docs/config.md) are the loop's (schema.py's optim group,
LOOP_KEYS), taken out before it is built.
The schedule scales each group's own lr, and the groups travel in the optimizer's state_dict, so a resume is exact.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

import torch
{% if cookiecutter.with_fsdp == "yes" %}
from torch.distributed.tensor import DTensor
{% endif %}

from .errors import UserError


def parameter_groups(model: torch.nn.Module, optim_cfg) -> list[dict]:
    """The optimizer's groups: the parameters no `param_groups` entry's glob `match` matches first, then each entry's
    (the first that matches wins) with its `lr x lr_scale` and weight decay, each split by `_split_decay`. Without
    entries: the optimizer's own one or two groups."""
    entries = optim_cfg.get("param_groups") or []
    chosen: list[list[torch.Tensor]] = [[] for _ in range(len(entries) + 1)]  # [0]: matched by no entry
    for name, p in model.named_parameters():
        if p.requires_grad:
            chosen[next((i for i, e in enumerate(entries, 1) if fnmatchcase(name, e["match"])), 0)].append(p)
    groups = _split_decay(chosen[0], {}, optim_cfg) if chosen[0] else []
    for i, (entry, params) in enumerate(zip(entries, chosen[1:])):
        if not params:
            first = next((n for n, _ in model.named_parameters()), "")
            raise UserError(
                f"optim.param_groups[{i}].match={entry['match']!r} matches no parameter of {type(model).__name__} "
                f"that an earlier entry left (names look like {first!r}): fix the glob or remove the entry"
            )
        settings = {}
        if entry.get("lr_scale") is not None:
            if optim_cfg.get("lr") is None:
                raise UserError("optim.param_groups: lr_scale needs optim.lr (the rate it scales): set optim.lr")
            settings["lr"] = optim_cfg["lr"] * entry["lr_scale"]
        if entry.get("weight_decay") is not None:
            settings["weight_decay"] = entry["weight_decay"]
        groups += _split_decay(params, settings, optim_cfg)
    return groups


def _split_decay(params: list, settings: dict, optim_cfg) -> list[dict]:
    """`params` as one group with `settings`, or two when its weight decay (the group's, else optim's) is on and
    decay_norm_and_bias=false: biases and normalization weights (ndim < 2) then get none, as in nanoGPT and timm."""
    if optim_cfg.get("decay_norm_and_bias", True) or not settings.get("weight_decay", optim_cfg.get("weight_decay")):
        return [{"params": params, **settings}]
    return [
        {"params": [p for p in params if p.ndim >= 2], **settings},
        {"params": [p for p in params if p.ndim < 2], **settings, "weight_decay": 0.0},
    ]


def clip_gradients(model: torch.nn.Module, max_norm: float | None, optimizer, scaler) -> torch.Tensor | None:
    """The global gradient norm before clipping (a device tensor, never read here), or None when clipping is off;
    with fp16's GradScaler the gradients are unscaled first, so the norm and the limit are in true units."""
    if max_norm is None:
        return None
    if scaler.is_enabled():
        scaler.unscale_(optimizer)
{% if cookiecutter.with_fsdp == "yes" %}
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm  # FSDP's shards give a DTensor (a collective)
{% else %}
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
{% endif %}
{% if cookiecutter.with_fsdp == "yes" or cookiecutter.with_doctor == "yes" %}


def state_slots(optimizer: torch.optim.Optimizer) -> int:
    """The per-parameter state tensors, each shaped like the parameter, that the shipped optimizers keep (for the model
    memory per rank): Adam's two moments, SGD's momentum buffer when momentum is on."""
    return 2 if "betas" in optimizer.defaults else int(bool(optimizer.defaults.get("momentum")))
{% endif %}
