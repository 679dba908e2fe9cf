"""Validation: loss and accuracy of a model over a whole split, summed on the device and read once (train.py
after each epoch, eval.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .device import device_batches, sum_and_read


@torch.no_grad()
def evaluate(model, loader, device: torch.device, world=None, prepare=None) -> tuple[float, float]:
    """(mean loss, accuracy) of `model` over every batch of `loader`.

    Each rank takes its share of the split (see `eval_loader`); the sums are added over ranks in one
    all-reduce and read to the host once. `prepare` is the data's device-side transform (train.py builds
    it from `data.normalize`); pass the same one the model was trained with.
    """
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, correct predictions
    count = 0
    for x, y in device_batches(loader, device):
        logits = model(prepare(x) if prepare is not None else x)
        loss_sum = F.cross_entropy(logits.float(), y, reduction="sum")
        sums += torch.stack([loss_sum.double(), (logits.argmax(1) == y).sum().double()])
        count += len(y)
    loss_sum, correct, count = sum_and_read([sums[0], sums[1], count], device, world)
    return loss_sum / count, correct / count
