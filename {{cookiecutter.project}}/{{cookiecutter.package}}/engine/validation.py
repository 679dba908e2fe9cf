"""Validation: the metrics of a whole split summed on the device and read once (train.py after each epoch, eval.py),
each rank its share of the split, the sums added over ranks in one all-reduce."""

from __future__ import annotations

import torch

from . import distributed, failures{% if cookiecutter.with_fsdp == "yes" %}, fsdp{% endif +%}
from .device import device_batches, sum_and_read
from .errors import UserError
from .task_results import check_metrics, report


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
    totals = sum_and_read(sums.values(), device, world)  # the one host read: plain floats
    if hasattr(task, "compute"):  # each total back in its shape, on the CPU (built, not read); else the floats
        pieces = torch.tensor(totals, dtype=torch.float64).split([total.numel() for total in sums.values()])
        totals = [piece.reshape(total.shape) for piece, total in zip(pieces, sums.values(), strict=True)]
    return report(task, dict(zip(sums, totals, strict=True)), target)
