"""What a task's `loss`, `metrics` and `compute` may return (tasks.py), checked in one line, and a split's figures from
its totals (`report`). The loop unpacks a loss on every step without looking at values (no host read); the dry step
checks the forms on two samples; validation.py sums the metrics of a split."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .errors import UserError


def split_loss(result) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, parts) of what `task.loss` returned: `parts` is {} for a bare loss. Python checks only."""
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict):
        return result
    return result, {}


def check_loss(result, target: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`split_loss`, refusing in one line naming the task a loss that is not a scalar with a gradient, or parts
    that are not 0-dim tensors under string names."""
    loss, parts = split_loss(result)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        shown = f"a tuple of {len(result)}" if isinstance(result, tuple) else repr(loss)
        raise UserError(
            f"task {target}: loss() must return a scalar tensor with a gradient, or (loss, parts) with parts a "
            f"dict of 0-dim tensors, got {shown}"
        )
    for name, part in parts.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise UserError(f"task {target}: loss() parts need names like 'dice' (logged as loss_<name>), got {name!r}")
        if not isinstance(part, torch.Tensor) or part.dim() != 0:
            what = f"a tensor of shape {tuple(part.shape)}" if isinstance(part, torch.Tensor) else type(part).__name__
            raise UserError(
                f"task {target}: loss() part {name!r} must be a 0-dim tensor (e.g. the term's batch mean), got {what}"
            )
    return loss, parts


def check_metrics(metrics, target: str, computes: bool) -> list[str]:
    """The names `task.metrics` returned, in its order, `count` last; a result that is not a dict of tensors (0-dim
    ones unless the task has `compute`) with a 0-dim `count` is refused in one line naming the task."""
    if not isinstance(metrics, Mapping) or not metrics:
        raise UserError(f"task {target}: metrics() must return a dict of summed tensors, got {type(metrics)}")
    if "count" not in metrics:
        raise UserError(
            f"task {target}: metrics() returned {', '.join(sorted(metrics))} but no 'count' entry: add "
            "'count' (the number of samples in the batch), by which every other sum is divided"
        )
    for name, value in metrics.items():
        if not isinstance(value, torch.Tensor):
            if not isinstance(value, (int, float)) or isinstance(value, bool):  # a number: `len(batch)` as a count
                raise UserError(
                    f"task {target}: metrics()[{name!r}] must be a tensor (a sum over the batch), got {value!r}"
                )
        elif value.numel() != 1 and (name == "count" or not computes):
            raise UserError(
                f"task {target}: metrics()[{name!r}] has shape {tuple(value.shape)}: "
                + ("count must be one number" if name == "count" else "a sum of that shape needs a compute(totals) "
                   "method on the task that turns the totals into figures; else return a 0-dim sum")
            )  # fmt: skip
    return [k for k in metrics if k != "count"] + ["count"]


def report(task, totals: dict, target: str) -> dict[str, float]:
    """The figures of a split from its totals (CPU float64 tensors of the metrics' shapes, or floats), `count` among
    them: `task.compute(totals)` when the task has it, else `total / count` for each entry; `count` itself last."""
    count = float(totals["count"])
    if not hasattr(task, "compute"):
        figures = {k: float(v) / max(count, 1.0) for k, v in totals.items()}
    else:
        computed = task.compute(dict(totals))
        if not isinstance(computed, Mapping) or not computed:
            raise UserError(f"task {target}: compute() must return a dict of figures by name, got {type(computed)}")
        figures = {}
        for name, value in computed.items():
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if not isinstance(name, str) or not isinstance(value, (int, float)) or isinstance(value, bool):
                raise UserError(
                    f"task {target}: compute()[{name!r}] must be a number (reported as val_<name>), got {value!r}"
                )
            figures[name] = float(value)
    figures.pop("count", None)  # the split's own count stands, last
    return {**figures, "count": count}
