"""Validation: the task's metrics over a whole split, summed on the device and read once (train.py after each
epoch, eval.py)."""

from __future__ import annotations

import torch

from . import failures
from .device import device_batches, sum_and_read
from .errors import UserError


def check_metrics(metrics, target: str) -> list[str]:
    """The names `task.metrics` returned, in its order, `count` last; a result that is not a dict of 0-dim
    tensors with a `count` is refused in one line naming the task."""
    if not isinstance(metrics, dict) or not metrics:
        raise UserError(f"task {target}: metrics() must return a dict of summed 0-dim tensors, got {type(metrics)}")
    if "count" not in metrics:
        raise UserError(
            f"task {target}: metrics() returned {', '.join(sorted(metrics))} but no 'count' entry: add "
            "'count' (the number of samples in the batch), by which every other sum is divided"
        )
    odd = [k for k, v in metrics.items() if not _one_number(v)]
    if odd:
        raise UserError(f"task {target}: metrics()[{odd[0]!r}] must be a 0-dim tensor (a sum over the batch)")
    return [k for k in metrics if k != "count"] + ["count"]


def _one_number(value) -> bool:
    """A 0-dim tensor, or a plain number (a `count` of `len(batch)`, say), which is taken as one."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@torch.no_grad()
def evaluate(task, model, loader, device: torch.device, world=None, prepare=None) -> dict[str, float]:
    """`{name: total / count}` of `task.metrics` over every batch of `loader`, `count` included as the total.

    Each rank takes its share of the split (see `eval_loader`); the sums are added over ranks in one
    all-reduce and read to the host once. `prepare` is the data's device-side transform (train.py builds
    it from `data.normalize`); pass the same one the model was trained with.
    """
    model.eval()
    names, sums = None, None
    for batch in failures.named(device_batches(loader, device), "validation"):
        metrics = task.metrics(model, prepare(batch) if prepare is not None else batch)
        if names is None:
            names = check_metrics(metrics, type(task).__qualname__)
            sums = torch.zeros(len(names), dtype=torch.float64, device=device)
        sums += torch.stack([torch.as_tensor(metrics[k], device=device).detach().reshape(()).double() for k in names])
    if names is None:
        raise UserError("validation: the split holds no samples for this process: give it more data")
    totals = dict(zip(names, sum_and_read(list(sums), device, world)))
    count = max(totals["count"], 1.0)
    return {**{k: v / count for k, v in totals.items() if k != "count"}, "count": totals["count"]}
