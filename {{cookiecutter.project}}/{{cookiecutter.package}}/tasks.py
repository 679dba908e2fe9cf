"""Tasks: what the model is trained to do. `conf/task/*.yaml` names one of these (or a class of your own) as its
`_target_`; train.py, eval.py{% if cookiecutter.with_doctor == "yes" %}, the config checks and the doctor{% else %} and the config checks{% endif %} know the problem only through it.

A task has two methods, both given the model and one batch exactly as the data set and `data.collate` made it
(a tensor, or tuples / lists / dicts of tensors), already on the device and through `data.normalize`:

- `loss(model, batch) -> Tensor`: the scalar training loss of the batch (the loop calls backward on it), or
  `(loss, parts)` with `parts` a dict of 0-dim tensors (a composite loss's terms), logged as `loss_<name>`.
- `metrics(model, batch) -> dict[str, Tensor]`: tensors *summed* over the batch, one of them `count`
  (how many samples the sums cover). The loop adds them up on the device over the whole validation set and
  over ranks, reads them once, and reports `val_<name> = total / count` for every other name: in
  metrics.jsonl, TensorBoard, eval.json, and as what `checkpoint.monitor` may pick for best.pth.
- `compute(totals) -> dict[str, float]`, optional: the figures from the split's totals (CPU tensors, `count`
  among them), for a figure that is not a mean over samples; the sums may then have any fixed shape
  (per-class vectors for mIoU or macro-F1).
- `count_unit`, optional: what `count` counts, as eval.py names it ("samples" when absent; e.g. "tokens").

Keep host reads (`.item()`, `float(t)`, printing a tensor) out of both: each one makes the host wait for the GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Classification:
    """Single-label classification: batches `(inputs, labels)`, the model returns one logit per class.

    `label_smoothing` softens the training targets (0 = plain cross-entropy). `val_loss` stays the plain
    cross-entropy whatever the smoothing, so runs with different smoothing compare on the same scale.
    """

    def __init__(self, label_smoothing: float = 0.0):
        self.label_smoothing = label_smoothing  # in [0, 1): the schema's range (task.label_smoothing)

    def loss(self, model, batch) -> torch.Tensor:
        inputs, labels = batch
        return F.cross_entropy(model(inputs), labels, label_smoothing=self.label_smoothing)

    def metrics(self, model, batch) -> dict[str, torch.Tensor]:
        inputs, labels = batch
        logits = model(inputs).float()
        return {
            "loss": F.cross_entropy(logits, labels, reduction="sum"),
            "acc": (logits.argmax(1) == labels).sum(),
            "count": labels.new_full((), labels.shape[0]),
        }


class Segmentation:
    """Semantic segmentation: batches `(images, masks)`, masks (N, H, W) of class indices; the model returns
    (N, num_classes, H, W) logits. Pixels of `ignore_index` count nowhere: not in the loss, not in the metrics.

    Reported: `val_loss` (cross-entropy per valid pixel), `val_pixel_acc` (correct / valid pixels) and `val_miou`,
    the mean over classes of intersection / union, from the split's summed per-class counts (not a mean of batch
    figures); a class absent from both the predictions and the masks (union 0) is left out of the mean.
    """

    def __init__(self, num_classes: int, ignore_index: int = 255):
        self.num_classes, self.ignore_index = num_classes, ignore_index

    def loss(self, model, batch) -> torch.Tensor:
        images, masks = batch
        return F.cross_entropy(model(images), masks, ignore_index=self.ignore_index)

    def metrics(self, model, batch) -> dict[str, torch.Tensor]:
        images, masks = batch
        logits = model(images).float()
        valid = masks != self.ignore_index
        # ignored pixels weigh 0 below: their cell is any valid one
        cells = torch.where(valid, masks, 0) * self.num_classes + logits.argmax(1)
        # the confusion matrix (truth x prediction) by a scatter-add of each valid pixel: no boolean indexing,
        # which would read the number of valid pixels back to the host; scatter_add_ has a deterministic CUDA kernel
        confusion = torch.zeros(self.num_classes**2, dtype=torch.long, device=masks.device)
        confusion = confusion.scatter_add_(0, cells.flatten(), valid.flatten().long()).view(self.num_classes, -1)
        intersection = confusion.diagonal()
        return {
            "loss": F.cross_entropy(logits, masks, ignore_index=self.ignore_index, reduction="sum"),
            "intersection": intersection,
            "union": confusion.sum(0) + confusion.sum(1) - intersection,
            "correct": intersection.sum(),
            "valid": valid.sum(),
            "count": masks.new_full((), masks.shape[0]),
        }

    def compute(self, totals: dict) -> dict[str, float]:
        present = totals["union"] > 0
        iou = totals["intersection"][present] / totals["union"][present]
        valid = max(float(totals["valid"]), 1.0)
        return {
            "loss": float(totals["loss"]) / valid,
            "miou": float(iou.mean()) if present.any() else 0.0,
            "pixel_acc": float(totals["correct"]) / valid,
        }
