"""Callbacks: what a run does beside training, picked in `conf/callbacks/` (`python train.py
'callbacks=[sample_grid,early_stopping]'`) or added by config (`+callbacks.<name>._target_=<your class>`).

The hooks and what `run` offers are in engine/callbacks.py. None of these changes the run: weights with them on are
the weights without them.
"""

from __future__ import annotations

import copy
import logging

import torch
from omegaconf import OmegaConf
from torch.utils.data import default_collate

from .engine import rng
from .engine.checkpoint import improves
from .engine.data_check import first_samples
from .engine.device import has_part, tensors, to_device
from .engine.errors import UserError
from .engine.schema import flatten

log = logging.getLogger(__name__)


class EarlyStopping:
    """Stop once `monitor` (a metrics.jsonl figure: val_acc, val_loss, train_loss...) has not improved by more than
    `min_delta` for `patience` validations in a row (`mode` max: higher is better; min: lower is better). The best
    value and the count travel in every checkpoint: a resumed run stops at the same step."""

    def __init__(self, monitor: str = "val_acc", mode: str = "max", patience: int = 3, min_delta: float = 0.0):
        if mode not in ("max", "min") or patience < 1 or min_delta < 0:
            raise ValueError(f"mode must be max or min, patience >= 1, min_delta >= 0; got {mode}, {patience}, "
                             f"{min_delta}")  # fmt: skip
        self.monitor, self.mode, self.patience, self.min_delta = monitor, mode, patience, min_delta
        self.best: float | None = None
        self.waited = 0  # validations since the last improvement

    def on_validation_end(self, run, record: dict) -> str | None:
        if self.monitor not in record:
            figures = ", ".join(k for k in record if k == "train_loss" or k.startswith("val_"))
            raise UserError(f"callbacks: EarlyStopping's monitor {self.monitor} is not reported; pick one of {figures}")
        value = record[self.monitor]
        better = improves(value, self.best, self.mode, self.min_delta)  # as best.pth judges, with min_delta
        self.best, self.waited = (value, 0) if better else (self.best, self.waited + 1)
        if self.waited < self.patience:
            return None
        return f"{self.monitor} has not improved on {self.best} for {self.waited} validations"

    def state_dict(self) -> dict:
        return {"best": self.best, "waited": self.waited}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.waited = state["best"], state["waited"]


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
        images = shown(batch, run.cfg.data.get("input", 0), run.prepare.normalize)
        if images is not None:
            run.runlog.image("samples/train", grid(images, self.columns), run.step)
        elif not self.told:
            self.told = True
            log.info("callbacks: sample_grid draws nothing: data.input=%s of the batch holds no images (a tensor "
                     "(N, C, H, W) or a list of (C, H, W), 1 or 3 channels)", run.cfg.data.get("input", 0))  # fmt: skip


class HParams:
    """The run's config (each key flattened, as a number or a word) and its final figures (the last validation's
    train_loss and val_*) in TensorBoard's HParams tab, as the run `tb/hparams`: the runs of a sweep compare side by
    side (`tensorboard --logdir outputs/<sweep folder>`)."""

    def __init__(self):
        self.last: dict | None = None

    def on_validation_end(self, run, record: dict) -> None:
        self.last = record

    def on_run_end(self, run) -> None:
        if self.last is None:
            return
        # each key as a number, bool or word; lists and None as words (what the HParams tab takes)
        config = flatten(OmegaConf.to_container(run.cfg, resolve=True, enum_to_str=True))
        config = {k: v if isinstance(v, (int, float, bool, str)) else str(v) for k, v in config.items() if v != {}}
        figures = {f"hparams/{k}": v for k, v in self.last.items() if k == "train_loss" or k.startswith("val_")}
        run.runlog.hparams(config, figures)


PALETTE = torch.tensor([[0, 0, 0], [230, 25, 75], [60, 180, 75], [255, 225, 25], [0, 130, 200], [245, 130, 48],
                        [145, 30, 180], [70, 240, 240], [240, 50, 230]], dtype=torch.float32) / 255  # fmt: skip


def shown(batch, key, normalize) -> torch.Tensor | None:
    """The batch's images (N, C, H, W), 1 or 3 channels, as people see them: (N, 3, H, W) in [0, 1], or None. The
    run's built data.normalize undone where it holds per-channel `mean` and `std` tensors (device.Normalize does),
    else each image stretched; an integer mask (N, H, W) beside them drawn over each image, its classes in colour,
    half and half, 0 (the background) and 255 (no class) left clear."""
    found = tensors(batch)  # however nested
    images = batch[key] if has_part(batch, key) else found[0] if found else None
    if isinstance(images, (list, tuple)) and images and all(torch.is_tensor(i) and i.dim() == 3 for i in images):
        images = padded(images) if len({i.shape[0] for i in images}) == 1 else None  # a detection batch's images
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
    colours = PALETTE.to(images.device)[(masks[0] % len(PALETTE)).long()].permute(0, 3, 1, 2)
    drawn = ((masks[0] > 0) & (masks[0] != 255)).unsqueeze(1)
    return torch.where(drawn, 0.5 * images + 0.5 * colours, images)


def padded(images) -> torch.Tensor:
    """Images (C, H, W) of their own sizes as one (N, C, H, W) batch, each padded at its bottom and right to the
    largest height and width."""
    h, w = max(i.shape[1] for i in images), max(i.shape[2] for i in images)
    return torch.stack([torch.nn.functional.pad(i, (0, w - i.shape[2], 0, h - i.shape[1])) for i in images])


def grid(images: torch.Tensor, columns: int, pad: int = 2) -> torch.Tensor:
    """(3, H', W') on the CPU: the images (N, 3, H, W) in rows of `columns`, `pad` pixels apart (no torchvision: see
    test_task)."""
    images = images.cpu()
    n, _, h, w = images.shape
    columns = min(columns, n)
    rows = -(-n // columns)
    out = torch.zeros(3, rows * (h + pad) + pad, columns * (w + pad) + pad)
    for i, image in enumerate(images):
        top, left = pad + (i // columns) * (h + pad), pad + (i % columns) * (w + pad)
        out[:, top : top + h, left : left + w] = image
    return out
