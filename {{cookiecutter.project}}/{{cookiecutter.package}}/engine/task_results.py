"""What a task's `loss`, `metrics` and `compute` may return (tasks.py), checked in one line, and validation: the
metrics of a whole split summed on the device and read once (train.py after each epoch, eval.py). The loop unpacks a
loss on every step without looking at values (no host read); the dry step checks the forms on two samples."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from . import distributed, failures{% if cookiecutter.with_fsdp == "yes" %}, fsdp{% endif +%}
from .device import device_batches, sum_and_read
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


@torch.no_grad()
def evaluate(task, model, loader, device: torch.device, world=None, prepare=None) -> dict[str, float]:
    """The figures of `task.metrics` over every batch of `loader` (`report`), `count` included as the total: each
    rank's share of the split (`eval_loader`), the sums added over ranks in one all-reduce and read once. `prepare`:
    the data's device-side transform (`data.normalize`), the one the model was trained with."""
    model.eval()
    distributed.main_buffers(model, world)  # every rank judges the weights rank 0 saves
    target = type(task).__qualname__
{% if cookiecutter.with_fsdp == "yes" %}
    sums = None
    batches = 0
    for batch in failures.named(device_batches(loader, device), loader):
        batches += 1
{% else %}
    sums = None
    for batch in failures.named(device_batches(loader, device), loader):
{% endif %}
        metrics = task.metrics(model, prepare(batch) if prepare is not None else batch)
        if sums is None:  # in check_metrics' order, `count` last
            names = check_metrics(metrics, target, hasattr(task, "compute"))
            sums = {k: torch.zeros(torch.as_tensor(metrics[k]).shape, dtype=torch.double, device=device) for k in names}
        for k in sums:
            value = torch.as_tensor(metrics[k], device=device).detach()
            if value.shape != sums[k].shape:  # shapes are metadata: checking them reads nothing from the device
                raise UserError(
                    f"task {target}: metrics()[{k!r}] has shape {tuple(value.shape)} on one batch and "
                    f"{tuple(sums[k].shape)} on another: return sums of one shape (e.g. per class, for every class)"
                )
            sums[k] += value.double()
    if sums is None:
        raise UserError("validation: the split holds no samples for this process: give it more data")
{% if cookiecutter.with_fsdp == "yes" %}
    if fsdp.is_sharded(model):  # every rank's forward gathers the weights with the others': as many on each
        for _ in range(distributed.most(batches, world, device) - batches):{% if cookiecutter.with_streams == "yes" %}  # a stream's count shows at its end{% endif +%}
            task.metrics(model, prepare(batch) if prepare is not None else batch)  # counted nowhere
{% endif %}
    totals = sum_and_read(list(sums.values()), device, world)  # the one host read: plain floats
    if hasattr(task, "compute"):  # each total back in its shape, on the CPU (built, not read); else the floats
        pieces = torch.tensor(totals, dtype=torch.float64).split([total.numel() for total in sums.values()])
        totals = [piece.reshape(total.shape) for piece, total in zip(pieces, sums.values(), strict=True)]
    return report(task, dict(zip(sums, totals, strict=True)), target)
