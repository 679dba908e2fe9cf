"""Small datasets for the tests, plugged in through `data.train._target_` like a user's own."""

import random
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from {{ cookiecutter.package }}.stream import ShardedStream


class RngDrawingDataset(Dataset):
    """Each item draws from the worker's global torch, numpy and python RNGs, as user augmentations do.

    The label is learnable from the clean part of the input, so training moves the weights; the
    noise makes every weight depend on every draw, so any RNG slip changes the result.
    """

    def __init__(self, size: int = 256, num_classes: int = 4, image_size: int = 16):
        self.size, self.num_classes, self.image_size = size, num_classes, image_size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        label = index % self.num_classes
        x = torch.full((3, self.image_size, self.image_size), float(label) / self.num_classes)
        x = x + 0.3 * torch.randn_like(x) + float(np.random.uniform(-0.1, 0.1)) + random.gauss(0.0, 0.1)
        return x, label


class SlowItems(RngDrawingDataset):
    """RngDrawingDataset whose items take `item_s` seconds each, like slow storage: workers stay busy long enough
    to watch."""

    def __init__(self, size: int = 256, num_classes: int = 4, image_size: int = 16, item_s: float = 0.01):
        super().__init__(size, num_classes, image_size)
        self.item_s = item_s

    def __getitem__(self, index: int):
        time.sleep(self.item_s)
        return super().__getitem__(index)


class CountingShard:
    """A stand-in shard reader: shard `s` holds records `(s, i)` for `i < per_shard`, each with a small tensor.

    A real reader opens a file here (tar, parquet, lines of JSON) and yields decoded samples.
    """

    def __init__(self, per_shard: int, size: int = 8):
        self.per_shard, self.size = per_shard, size

    def __call__(self, shard: int) -> Iterator[tuple[int, int, torch.Tensor]]:
        for i in range(self.per_shard):
            yield shard, i, torch.full((self.size,), float(shard * self.per_shard + i))


def counting_stream(num_shards: int = 8, per_shard: int = 100) -> ShardedStream:
    return ShardedStream(range(num_shards), CountingShard(per_shard))


def export_digits(root: Path, val_every: int = 5) -> Path:
    """scikit-learn's handwritten digits (1,797 real 8x8 scans of 10 digits, shipped with the package: no download)
    as an image folder, `root/{train,val}/<digit>/<n>.png`; every `val_every`-th scan goes to val."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    for n, (image, label) in enumerate(zip(digits.images, digits.target)):
        folder = root / ("val" if n % val_every == 0 else "train") / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray((image * 255 / 16).round().astype(np.uint8), "L").save(folder / f"{n:04d}.png")  # 0-16 scale
    return root
