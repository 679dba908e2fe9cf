"""The learning-rate schedule: linear warm-up, then cosine decay, stepped once per optimizer step."""

from __future__ import annotations

import math

from torch.optim.lr_scheduler import LambdaLR


class WarmupCosine:
    """lr factor at a step. A callable object rather than a lambda, so LambdaLR's state_dict can hold it."""

    def __init__(self, warmup_steps: int, total_steps: int, min_lr_ratio: float):
        self.warmup_steps, self.total_steps, self.min_lr_ratio = warmup_steps, total_steps, min_lr_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def warmup_cosine(optimizer, total_steps: int, warmup_steps: int, min_lr_ratio: float) -> LambdaLR:
    # The schedule spans the planned run (epochs), never max_steps: a run stopped early and resumed sees the same lr.
    return LambdaLR(optimizer, WarmupCosine(warmup_steps, total_steps, min_lr_ratio))
