"""Data sets: the generated shapes default, any image folder, and CIFAR-10 from a local copy.

Every `data.train` / `data.val` node in `conf/data/` is a Hydra `_target_`: plug in any map-style
Dataset class the same way. File lists are kept in numpy arrays, not Python lists of tuples: each
worker touching a list of many Python objects writes to their refcounts and so copies the pages
it forked from the parent (copy-on-read, pytorch/pytorch#13246); a numpy array is one object.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw
from torchvision import datasets
from torchvision.datasets.folder import find_classes
{% if cookiecutter.with_benchmarks == "yes" %}
from torchvision.transforms import v2
{% endif %}

from .engine.errors import UserError

SHAPES = ("circle", "square", "triangle", "cross")
SHAPES_FORMAT = 1  # bump when the drawing changes, so an old folder is not silently reused


{% if cookiecutter.with_benchmarks == "yes" %}
def train_transform(image_size: int) -> v2.Compose:
    """The shapes config's training transform, for code outside Hydra (the benchmarks): conf/data/*.yaml lists the
    same steps. It runs in the workers and draws from their torch RNG; its output stays uint8 (C, H, W), and
    train.py turns it into normalized floats on the device (`data.normalize`, device.Normalize)."""
    return v2.Compose(
        [
            v2.ToImage(),
            v2.RandomResizedCrop(image_size, scale=(0.6, 1.0), ratio=(0.8, 1.25), antialias=True),
            v2.RandomHorizontalFlip(),
        ]
    )


{% endif %}
class ImageFiles(datasets.ImageFolder):
    """`torchvision.datasets.ImageFolder` (one subfolder per class, PIL decoding in the worker)
    with its file list held in numpy arrays instead of a list of (path, class) tuples."""

    def __init__(self, root, transform=None):
        root = Path(root)
        self.precheck(root)
        try:
            super().__init__(str(root), transform=transform)
        except FileNotFoundError as e:
            raise UserError(
                f"no images found under {str(root)!r} ({e}): put one subfolder of images per class there"
            ) from None
        self.paths = np.array([path for path, _ in self.samples])
        self.labels = np.array([label for _, label in self.samples], dtype=np.int64)
        self.samples = self.imgs = self.targets = None  # drop the per-file Python objects

    @staticmethod
    def precheck(root, **_) -> list[str]:
        """The class folders under `root`, or a UserError: what train.py checks before Hydra writes a run folder,
        without listing the images (one directory read, however many files there are)."""
        root = Path(root)
        if not root.is_dir():
            raise UserError(
                f"data folder {str(root)!r} does not exist: point data.root at a folder holding "
                "train/ and val/, each with one subfolder of images per class"
            )
        try:
            return find_classes(str(root))[0]
        except FileNotFoundError as e:
            raise UserError(
                f"no class folders under {str(root)!r} ({e}): put one subfolder of images per class there"
            ) from None

    def __len__(self) -> int:
        return len(self.paths)

    def sample_source(self, index: int) -> str:
        """Where sample `index` comes from, for the line that names a bad sample (engine/failures.py)."""
        return f"file {self.paths[index]}"

    def __getitem__(self, index: int):
        image = self.loader(str(self.paths[index]))
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.labels[index])


def shapes(root, split: str, transform=None, per_class: int = 600, image_size: int = 32, data_seed: int = 2026):
    """One split of the shapes data set, drawn into `root` on first use."""
    make_shapes(Path(root), per_class=per_class, image_size=image_size, data_seed=data_seed)
    return ImageFiles(Path(root) / split, transform=transform)


def precheck_shapes(root, per_class: int = 600, image_size: int = 32, data_seed: int = 2026, **_) -> list[str]:
    """What `shapes()` would refuse, without drawing anything: a folder holding other shapes or other files."""
    drawn(Path(root), recipe(per_class, image_size, data_seed))
    return sorted(SHAPES)  # the class folders, in ImageFolder's order


shapes.precheck = precheck_shapes  # config.CheckBeforeRun calls a target's `precheck` before Hydra writes anything


def recipe(per_class: int, image_size: int, data_seed: int) -> dict:
    """What a shapes folder was drawn with: stored beside the images as shapes.json and checked on reuse."""
    return {"format": SHAPES_FORMAT, "per_class": per_class, "image_size": image_size, "data_seed": data_seed}


def drawn(root: Path, wanted: dict) -> bool:
    """True when `root` holds shapes drawn with the recipe `wanted`, False when it is not there yet; else UserError."""
    marker = root / "shapes.json"
    if marker.exists():
        if json.loads(marker.read_text()) != wanted:
            raise UserError(
                f"{str(root)!r} holds shapes drawn with other settings ({marker.read_text().strip()}): "
                "delete that folder or set data.root to a new one"
            )
        return True
    if root.exists():
        raise UserError(
            f"{str(root)!r} exists but is not a generated shapes folder: set data.root to an empty or new path"
        )
    return False


def make_shapes(root: Path, per_class: int, image_size: int, data_seed: int) -> None:
    """Draw the PNG files once; concurrent callers (DDP ranks, parallel tests) race safely.

    The folder is built under a temporary name and renamed into place, so a reader never sees
    half of it; the recipe is stored beside the images and checked on reuse.
    """
    marker, wanted = root / "shapes.json", recipe(per_class, image_size, data_seed)
    if drawn(root, wanted):
        return
    tmp = root.parent / f".{root.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    rng = np.random.default_rng(data_seed)
    for split, count in (("train", per_class), ("val", max(per_class // 5, 1))):
        for name in SHAPES:
            folder = tmp / split / name
            folder.mkdir(parents=True)
            for i in range(count):
                draw_shape(name, image_size, rng).save(folder / f"{i:05d}.png")
    (tmp / "shapes.json").write_text(json.dumps(wanted))
    try:
        os.rename(tmp, root)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
        if not marker.exists():
            raise


def draw_shape(name: str, size: int, rng: np.random.Generator) -> Image.Image:
    """One noisy image of `name`: random colours, size, position and rotation."""
    background = rng.integers(0, 256, 3)
    colour = (background + rng.integers(80, 176, 3)) % 256  # always far from the background
    pixels = np.clip(background + rng.normal(0, 12, (size, size, 3)), 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels, "RGB")
    radius = rng.uniform(0.2, 0.38) * size
    cx, cy = rng.uniform(radius, size - radius, 2)
    angle = rng.uniform(0, 2 * math.pi)
    fill = tuple(int(c) for c in colour)
    pen = ImageDraw.Draw(image)
    if name == "circle":
        pen.ellipse([cx - radius, cy - radius, cx + radius, cy + radius], fill=fill)
    elif name == "cross":
        arm = radius * 0.3
        for a in (angle, angle + math.pi / 2):
            dx, dy = math.cos(a), math.sin(a)
            px, py = -dy * arm, dx * arm
            pen.polygon(
                [
                    (cx + dx * radius + px, cy + dy * radius + py),
                    (cx + dx * radius - px, cy + dy * radius - py),
                    (cx - dx * radius - px, cy - dy * radius - py),
                    (cx - dx * radius + px, cy - dy * radius + py),
                ],
                fill=fill,
            )
    else:
        corners = 4 if name == "square" else 3
        pen.polygon(
            [
                (cx + radius * math.cos(a), cy + radius * math.sin(a))
                for a in (angle + 2 * math.pi * k / corners for k in range(corners))
            ],
            fill=fill,
        )
    return image


def cifar10(root, train: bool, transform=None, download: bool = False):
    """CIFAR-10 from a local `cifar-10-batches-py` folder; downloading stays off unless asked for."""
    try:
        return datasets.CIFAR10(str(root), train=train, transform=transform, download=download)
    except RuntimeError as e:
        raise UserError(no_cifar(root, e)) from None


def precheck_cifar10(root, download: bool = False, **_) -> None:
    """No local copy and no download asked for: refused before the run, as `cifar10()` would refuse it."""
    if not download and not (Path(root) / datasets.CIFAR10.base_folder).is_dir():
        raise UserError(no_cifar(root, f"no {datasets.CIFAR10.base_folder} folder"))


cifar10.precheck = precheck_cifar10


def no_cifar(root, why) -> str:
    return (
        f"no CIFAR-10 under {str(root)!r} ({why}): copy cifar-10-batches-py there, or set data.download=true "
        "on a machine with internet"
    )
