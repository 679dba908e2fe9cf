"""The learning-rate schedule (`conf/schedule/`), stepped once per optimizer step.

Each file in conf/schedule/ is a `_target_` with `_partial_: true` (docs/config.md): any torch LR scheduler class,
or a function returning one, takes the optimizer from the loop, and `total_steps` when it takes an argument of that
name (parts.schedule). A `resume_strict=false` resume that changes the run steps this run's schedule to the
checkpoint's step (`fast_forward`). ReduceLROnPlateau, which steps on a metric, is not supported.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

from torch.optim.lr_scheduler import LambdaLR


@dataclass
class WarmupCosine:
    """lr factor at a step: linear warm-up over `warmup_steps`, then a cosine decay to `min_lr_ratio` at
    `total_steps` (min_lr_ratio=1: flat). An object, not a lambda, so LambdaLR's state_dict holds it."""

    warmup_steps: int
    total_steps: int = 1
    min_lr_ratio: float = 1.0

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def warmup_cosine(optimizer, total_steps: int, warmup_steps: int, min_lr_ratio: float) -> LambdaLR:
    """The default schedule: warm-up, then cosine decay over `total_steps` (parts.schedule passes it)."""
    return LambdaLR(optimizer, WarmupCosine(warmup_steps, total_steps, min_lr_ratio))


def constant(optimizer, warmup_steps: int = 0) -> LambdaLR:
    """An optional linear warm-up, then the optimizer's lr."""
    return LambdaLR(optimizer, WarmupCosine(warmup_steps))


def fast_forward(scheduler, steps: int) -> None:
    """Step a freshly built scheduler `steps` times: the LR it gives at that step, from its own public `step()`."""
    with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": intended here
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(steps):
            scheduler.step()
