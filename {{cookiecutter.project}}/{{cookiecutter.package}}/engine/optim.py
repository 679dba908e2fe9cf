"""The optimizer from `conf/optim/`, and the two knobs the loop applies around it.

`conf/optim/*.yaml` names any optimizer class (`_partial_: true`; the parameters come from here). Two keys of
the group are the loop's, not the optimizer's, and are taken out before it is built:

- `grad_clip`: clip the global gradient norm to this value before each optimizer step (null = off).
- `decay_norm_and_bias`: false (the default) puts biases and normalization weights, every parameter with fewer
  than two dimensions, in a group without weight decay, as nanoGPT and timm do.
"""

from __future__ import annotations

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

LOOP_KEYS = ("grad_clip", "decay_norm_and_bias")  # read by the loop; the optimizer never sees them


def optimizer_node(optim_cfg):
    """The optim config without the loop's keys: what the optimizer class is built from."""
    node = OmegaConf.to_container(OmegaConf.create(optim_cfg), resolve=True)
    return OmegaConf.create({k: v for k, v in node.items() if k not in LOOP_KEYS})


def parameter_groups(model: torch.nn.Module, optim_cfg) -> list[dict]:
    """One group, or two when weight decay is on and `decay_norm_and_bias` is false: matrices and convolution
    kernels decay, biases and normalization weights (ndim < 2) do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    if optim_cfg.get("decay_norm_and_bias", True) or not optim_cfg.get("weight_decay"):
        return [{"params": params}]
    return [
        {"params": [p for p in params if p.ndim >= 2]},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def build_optimizer(optim_cfg, model: torch.nn.Module) -> torch.optim.Optimizer:
    return instantiate(optimizer_node(optim_cfg))(parameter_groups(model, optim_cfg))


def clip_gradients(model: torch.nn.Module, max_norm: float | None, optimizer, scaler) -> torch.Tensor | None:
    """The global gradient norm before clipping (a device tensor, never read here), or None when clipping is off.

    With fp16's GradScaler the gradients are unscaled first, so the norm and the limit are in true units."""
    if max_norm is None:
        return None
    if scaler.is_enabled():
        scaler.unscale_(optimizer)
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
