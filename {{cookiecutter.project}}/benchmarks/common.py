"""What the loader benchmarks share. Run them from the project root: `python -m benchmarks.pN_...`."""

import time

from torchvision.transforms import v2


def samples_per_s(loader, epochs: int) -> float:
    """Samples/s over `epochs` timed epochs, after one warm-up epoch (workers start, files enter the page cache)."""
    for _ in loader:
        pass
    samples, began = 0, time.perf_counter()
    for _ in range(epochs):
        for x, _y in loader:
            samples += len(x)
    return samples / (time.perf_counter() - began)


def train_transform(image_size: int) -> v2.Compose:
    """The shapes config's training transform (conf/data/shapes.yaml lists the same steps), built outside Hydra: it
    runs in the workers and draws from their torch RNG; its output stays uint8 (C, H, W), and train.py turns it into
    normalized floats on the device (`data.normalize`, device.Normalize)."""
    return v2.Compose(
        [
            v2.ToImage(),
            v2.RandomResizedCrop(image_size, scale=(0.6, 1.0), ratio=(0.8, 1.25), antialias=True),
            v2.RandomHorizontalFlip(),
        ]
    )
