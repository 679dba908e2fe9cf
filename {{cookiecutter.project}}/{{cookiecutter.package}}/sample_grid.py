"""SampleGrid: training samples as they enter the model, in one TensorBoard image (`samples/train`). A module of its
own: it needs torchvision's drawing (make_grid, draw_segmentation_masks), which a project without images need not
import (docs/your-own-task.md's regression runs with `callbacks=[hparams]`)."""

from __future__ import annotations

import copy
import logging

import torch
from torch.utils.data import default_collate
from torchvision.utils import draw_segmentation_masks, make_grid

from .engine import rng
from .engine.data_check import first_samples
from .engine.device import has_part, tensors, to_device

log = logging.getLogger(__name__)


class SampleGrid:
    """`count` training samples as they enter the model (collated, on the device, through data.normalize), `shown`
    as people see them in one TensorBoard image, `samples/train`: at the run's start and, with `every_epoch`, after
    each epoch's validation (the epoch's augmentations; a segmentation mask over its image), read and augmented
    under RNG states of their own (each epoch's from the seed): the run's generators are left as they were."""

    def __init__(self, count: int = 16, every_epoch: bool = False, columns: int = 8):
        if count < 1 or columns < 1:
            raise ValueError(f"count and columns must be at least 1, got {count} and {columns}")
        self.count, self.every_epoch, self.columns = count, every_epoch, columns
        self.told = False  # that the batches hold no images to draw: said once

    def on_run_start(self, run) -> None:
        self.draw(run, run.train_loader.epoch)

    def on_validation_end(self, run, record: dict) -> None:
        if self.every_epoch and not record.get("mid_epoch"):
            self.draw(run, record["epoch"])

    def draw(self, run, epoch: int) -> None:
        if not run.world.is_main:
            return
        with rng.kept():  # a shallow copy: a data set that opens its files on first use does so on the copy
            rng.seed_everything(rng.derived(run.cfg.seed, epoch, 7))  # this epoch's draws, the same on every run
            samples = first_samples(copy.copy(run.train_set), "data.train", self.count)
            batch = run.prepare(to_device((run.collate or default_collate)(samples), run.device))
        key = run.cfg.data.get("input", 0)
        images = shown(batch, key, run.prepare.normalize)
        if images is not None:
            run.runlog.image("samples/train", make_grid(images.cpu(), nrow=self.columns), run.step)
        elif not self.told:
            self.told = True
            log.info("callbacks: sample_grid draws nothing: data.input=%s of the batch holds no images (a tensor "
                     "(N, C, H, W) or a list of (C, H, W), 1 or 3 channels)", key)  # fmt: skip


def shown(batch, key, normalize) -> torch.Tensor | None:
    """The batch's images (N, C, H, W), 1 or 3 channels, as people see them: (N, 3, H, W) in [0, 1], or None. The
    run's built data.normalize undone where it holds per-channel `mean` and `std` tensors (device.Normalize does),
    else each image stretched; an integer mask (N, H, W) beside them drawn over each image, each class in a colour
    of its own, half and half, 0 (the background) and 255 (no class) left clear. Images of their own sizes (a
    detection batch's list) are padded at their bottom and right to the largest."""
    found = tensors(batch)  # however nested
    images = batch[key] if has_part(batch, key) else found[0] if found else None
    if isinstance(images, (list, tuple)) and images and all(torch.is_tensor(i) and i.dim() == 3 for i in images):
        h, w = max(i.shape[1] for i in images), max(i.shape[2] for i in images)
        padded = [torch.nn.functional.pad(i, (0, w - i.shape[2], 0, h - i.shape[1])) for i in images]
        images = torch.stack(padded) if len({i.shape[0] for i in images}) == 1 else None  # one channel count
    if not (torch.is_tensor(images) and images.dim() == 4 and images.shape[1] in (1, 3)):
        return None
    side = images.shape[:1] + images.shape[2:]  # (N, H, W)
    masks = [t for t in found if t.dim() == 3 and not t.is_floating_point() and t.shape == side]
    mean, std, images = getattr(normalize, "mean", None), getattr(normalize, "std", None), images.float()
    if isinstance(mean, torch.Tensor) and isinstance(std, torch.Tensor):
        images = images * std + mean
    else:
        low = images.amin(dim=(1, 2, 3), keepdim=True)
        images = (images - low) / (images.amax(dim=(1, 2, 3), keepdim=True) - low).clamp_min(1e-8)
    images = images.clamp(0, 1).expand(-1, 3, -1, -1)
    if not masks:
        return images
    drawn = []
    for image, mask in zip(images, masks[0]):
        classes = [c for c in mask.unique().tolist() if c not in (0, 255)]
        colours = [(c * 47 % 256, c * 97 % 256, c * 193 % 256) for c in classes]  # a class keeps its colour
        each = mask == torch.tensor(classes, device=mask.device).view(-1, 1, 1)
        drawn.append(draw_segmentation_masks(image, each, alpha=0.5, colors=colours) if classes else image)
    return torch.stack(drawn)
