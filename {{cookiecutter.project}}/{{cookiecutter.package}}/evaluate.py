"""Validation: loss and accuracy of a model over a whole split, shared by train.py and eval.py."""

import torch
import torch.nn.functional as F

from . import distributed


@torch.no_grad()
def evaluate(model, loader, device, world) -> tuple[float, float]:
    """Loss and accuracy over the whole validation set: each rank takes its share, the sums are added."""
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits = model(x)
        loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
        correct += (logits.argmax(1) == y).sum().item()
        count += len(y)
    loss_sum, correct, count = distributed.sum_all([loss_sum, correct, count], device, world)
    return loss_sum / count, correct / count
