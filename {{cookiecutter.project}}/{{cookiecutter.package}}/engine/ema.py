"""An exponential moving average of the model's weights (`ema.decay`), kept beside the model.

After each optimizer step every floating-point tensor of the model's state (weights and normalization running
statistics) moves toward the model's: `ema = ema + (1 - decay) * (model - ema)`; integer buffers (BatchNorm's
step count) are copied. Validation, best.pth and eval.py use the average when it is on; checkpoints hold both.
"""

from __future__ import annotations

import copy

import torch
from torch.optim.swa_utils import get_ema_multi_avg_fn


class EMA:
{% if cookiecutter.with_fsdp == "yes" %}
    """`model`: the average, in a copy of the weights of the model passed in (`average`: parallel=fsdp builds one
    sharded like it; by default a deep copy). A checkpoint's EMA loads into it with `model.load_state_dict`, which
    copies into the same tensors, so the pairs averaged stay valid."""

    def __init__(self, model: torch.nn.Module, decay: float, average: torch.nn.Module | None = None):
        self.average = get_ema_multi_avg_fn(decay)  # torch's own EMA step, all tensors at once
        self.model = (average if average is not None else copy.deepcopy(model)).eval().requires_grad_(False)
{% else %}
    """`model`: the average, in a deep copy of the model passed in. A checkpoint's EMA loads into it with
    `model.load_state_dict`, which copies into the same tensors, so the pairs averaged stay valid."""

    def __init__(self, model: torch.nn.Module, decay: float):
        self.average = get_ema_multi_avg_fn(decay)  # torch's own EMA step, all tensors at once
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
{% endif %}
        # the tensors to average, matched by name once: state_dict() hands out the live tensors
        ours, theirs = self.model.state_dict(), model.state_dict()
        floats = [k for k, v in ours.items() if v.is_floating_point()]
{% if cookiecutter.with_fsdp == "yes" %}
        # FSDP: DTensor weights and plain buffers, averaged apart; each (ours, theirs) in the same order
        kinds = sorted({type(ours[k]) for k in floats}, key=lambda kind: kind.__name__)
        self.floats = [tuple([d[k] for k in floats if type(ours[k]) is kind] for d in (ours, theirs)) for kind in kinds]
{% else %}
        self.floats = [tuple([d[k] for k in floats] for d in (ours, theirs))]  # (ours, theirs), in the same order
{% endif %}
        others = [k for k, v in ours.items() if not v.is_floating_point()]
        self.others = tuple([d[k] for k in others] for d in (ours, theirs))

    @torch.no_grad()
    def update(self) -> None:
        """One step toward the model's current weights; all on the device, no host read."""
        for ours, theirs in self.floats:
            self.average(ours, theirs, None)
        for mine, theirs in zip(*self.others):
            mine.copy_(theirs)
