"""Validation: the task's metrics over a whole split, summed on the device and read once (train.py after each
epoch, eval.py); the figures from the totals through the task's `compute`, or `total / count` (task_results.py)."""

from __future__ import annotations

import math

import torch

from . import distributed, failures{% if cookiecutter.with_fsdp == "yes" %}, fsdp{% endif +%}
from .device import device_batches, sum_and_read
from .errors import UserError
from .task_results import check_metrics, report


@torch.no_grad()
def evaluate(task, model, loader, device: torch.device, world=None, prepare=None) -> dict[str, float]:
    """The figures of `task.metrics` over every batch of `loader` (see `report`), `count` included as the total.

    Each rank takes its share of the split (see `eval_loader`); the sums, of any shape, are added over ranks in one
    all-reduce of their flattened elements and read to the host once. `prepare` is the data's device-side transform
    (train.py builds it from `data.normalize`); pass the same one the model was trained with.
    """
    model.eval()
    distributed.main_buffers(model, world)  # every rank judges the weights rank 0 saves
    target = type(task).__qualname__
{% if cookiecutter.with_fsdp == "yes" %}
    names, sums, batches = None, None, 0
    for batch in failures.named(device_batches(loader, device), "validation"):
        batches += 1
{% else %}
    names, sums = None, None
    for batch in failures.named(device_batches(loader, device), "validation"):
{% endif %}
        metrics = task.metrics(model, prepare(batch) if prepare is not None else batch)
        if names is None:
            names = check_metrics(metrics, target, hasattr(task, "compute"))
            shapes = {k: torch.as_tensor(metrics[k]).shape for k in names}
            sums = {k: torch.zeros(shapes[k], dtype=torch.float64, device=device) for k in names}
        for k in names:
            value = torch.as_tensor(metrics[k], device=device).detach()
            if value.shape != sums[k].shape:  # shapes are metadata: checking them reads nothing from the device
                raise UserError(
                    f"task {target}: metrics()[{k!r}] has shape {tuple(value.shape)} on one batch and "
                    f"{tuple(sums[k].shape)} on another: return sums of one shape (e.g. per class, for every class)"
                )
            sums[k] += value.double()
    if names is None:
        raise UserError("validation: the split holds no samples for this process: give it more data")
{% if cookiecutter.with_fsdp == "yes" %}
    if fsdp.is_sharded(model):  # every rank's forward gathers the weights with the others': as many on each
        for _ in range(distributed.most(batches, world, device) - batches):{% if cookiecutter.with_streams == "yes" %}  # a stream's count shows at its end{% endif +%}
            task.metrics(model, prepare(batch) if prepare is not None else batch)  # counted nowhere
{% endif %}
    flat = sum_and_read([sums[k] for k in names], device, world)
    if not hasattr(task, "compute"):  # 0-dim sums only (check_metrics): the floats read are the totals
        return report(task, dict(zip(names, flat)), target)
    totals, at = {}, 0
    for k in names:  # the task's compute gets each total back in its shape, on the CPU (built, not read)
        size = math.prod(sums[k].shape)
        totals[k] = torch.tensor(flat[at : at + size], dtype=torch.float64).reshape(sums[k].shape)
        at += size
    return report(task, totals, target)
