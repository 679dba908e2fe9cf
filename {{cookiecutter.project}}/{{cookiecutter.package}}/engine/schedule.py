"""The learning-rate schedule (`conf/schedule/`), stepped once per optimizer step.

Each file in conf/schedule/ is a `_target_` with `_partial_: true`: any torch LR scheduler class, or a function
returning one, takes the optimizer from the loop; `total_steps` (the optimizer steps of all epochs) is passed too
when the target takes an argument of that name. Shipped: `warmup_cosine` (linear warm-up, cosine decay; the
default), `constant` (an optional warm-up, then flat) and `multistep` (torch's MultiStepLR).

A resume restores the schedule through its `state_dict()`; a `resume_strict=false` resume that changes the run
builds this run's schedule and steps it to the checkpoint's step instead (`fast_forward`), so the LR is the one
this config plans there. ReduceLROnPlateau, which steps on a metric, is not supported.
"""

from __future__ import annotations

import inspect
import math
import warnings

from hydra.utils import instantiate
from torch.optim.lr_scheduler import LambdaLR
{% if cookiecutter.with_streams == "yes" %}

from .errors import UserError
{% endif %}


class WarmupCosine:
    """lr factor at a step. A callable object rather than a lambda, so LambdaLR's state_dict can hold it."""

    def __init__(self, warmup_steps: int, total_steps: int, min_lr_ratio: float):
        self.warmup_steps, self.total_steps, self.min_lr_ratio = warmup_steps, total_steps, min_lr_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class Warmup:
    """lr factor: linear warm-up over `warmup_steps`, then 1."""

    def __init__(self, warmup_steps: int):
        self.warmup_steps = warmup_steps

    def __call__(self, step: int) -> float:
        return (step + 1) / self.warmup_steps if step < self.warmup_steps else 1.0


def warmup_cosine(optimizer, total_steps: int, warmup_steps: int, min_lr_ratio: float) -> LambdaLR:
    # The schedule spans the planned run (epochs) or `schedule.total_steps`, never max_steps: max_steps is where a
    # run stops and saves, and a run stopped there and resumed must see the lr the run never stopped sees.
    return LambdaLR(optimizer, WarmupCosine(warmup_steps, total_steps, min_lr_ratio))


def constant(optimizer, warmup_steps: int = 0) -> LambdaLR:
    return LambdaLR(optimizer, Warmup(warmup_steps))


def build_schedule(schedule_cfg, optimizer, total_steps: int{% if cookiecutter.with_streams == "yes" %} | None{% endif %}):
    """The configured scheduler on `optimizer`; `total_steps` (the planned epochs' optimizer steps) goes to targets
    that take it, unless the config sets `schedule.total_steps` itself: a schedule of its own length."""
    factory = instantiate(schedule_cfg)
    if schedule_cfg.get("total_steps") is not None:
        return factory(optimizer)
    try:
        takes_total = "total_steps" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        takes_total = False
{% if cookiecutter.with_streams == "yes" %}
    if takes_total and total_steps is None:
        raise UserError(
            f"schedule {schedule_cfg._target_} spans the run's steps, and a stream without sizes has no known "
            "epoch length: set schedule.total_steps, give the data set `sizes`, or use schedule=constant"
        )
{% endif %}
    return factory(optimizer, total_steps=total_steps) if takes_total else factory(optimizer)


def fast_forward(scheduler, steps: int) -> None:
    """Step a freshly built scheduler `steps` times: the LR it gives at that step, from its own public `step()`."""
    with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": intended here
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(steps):
            scheduler.step()
