"""Data sets: the generated shapes default, any image folder, segmentation image/mask pairs (generated shapes or
your own folder), and CIFAR-10 from a local copy.

Every `data.train` / `data.val` node in `conf/data/` is a Hydra `_target_`: plug in any map-style
Dataset class the same way. File lists are kept in numpy arrays, not Python lists of tuples: each
worker touching a list of many Python objects writes to their refcounts and so copies the pages
it forked from the parent (copy-on-read, pytorch/pytorch#13246); a numpy array is one object.
"""

from __future__ import annotations

{% if cookiecutter.with_photos == "no" %}
import io
{% endif %}
import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw
from torchvision import datasets, tv_tensors
from torchvision.datasets.folder import find_classes
from torchvision.transforms.v2.functional import pil_to_tensor

{% if cookiecutter.with_photos == "yes" %}
from .engine.decode import CropDecoder
{% endif %}
from .engine.errors import UserError

SHAPES = ("circle", "square", "triangle", "cross")
SHAPES_FORMAT = 1  # bump when the drawing changes, so an old folder is not silently reused
IGNORE = 255  # a mask pixel of this value has no class: left out of the loss and the metrics
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


class ImageFiles(datasets.ImageFolder):
{% if cookiecutter.with_photos == "yes" %}
    """`torchvision.datasets.ImageFolder` (one subfolder per class, decoding in the worker) with its file list held
    in numpy arrays instead of a list of (path, class) tuples; a JPEG decoded only as far as the transform's first
    crop needs (`decode`, data.decode: `CropDecoder`)."""

    def __init__(self, root, transform=None, decode: str = "auto"):
{% else %}
    """`torchvision.datasets.ImageFolder` (one subfolder per class, PIL decoding in the worker) with its file list held
    in numpy arrays instead of a list of (path, class) tuples."""

    def __init__(self, root, transform=None):
{% endif %}
        self.precheck(root)
        try:
            super().__init__(str(root), transform=transform)
        except FileNotFoundError as e:
            raise UserError(
                f"no images found under {str(root)!r} ({e}): put one subfolder of images per class there"
            ) from None
        paths, labels = zip(*self.samples)  # ImageFolder refused an empty folder
        self.paths, self.labels = np.array(paths), np.array(labels, dtype=np.int64)
        self.samples = self.imgs = self.targets = None  # drop the per-file Python objects
{% if cookiecutter.with_photos == "yes" %}
        self.reader = CropDecoder(transform, decode)
        self.collate_fn = self.reader.collate_fn  # decode=gpu: a batch's files kept as a list (parts.collate)
{% endif %}

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
            return find_classes(root)[0]
        except FileNotFoundError as e:
            raise UserError(
                f"no class folders under {str(root)!r} ({e}): put one subfolder of images per class there"
            ) from None

    def __len__(self) -> int:
        return len(self.paths)

    def sample_source(self, index: int) -> str:
        """Where sample `index` comes from, for the line that names a bad sample (engine/failures.py)."""
        return f"file {self.paths[index]}"

    def read(self, index: int) -> bytes:
{% if cookiecutter.with_photos == "yes" %}
        """The file's bytes, read whole: PIL and torchvision.io decode from memory (one open and one read)."""
{% else %}
        """The file's bytes, read whole: PIL decodes from memory (one open and one read)."""
{% endif %}
        return Path(self.paths[index]).read_bytes()

    def __getitem__(self, index: int):
{% if cookiecutter.with_photos == "yes" %}
        return self.reader(self.read(index)), int(self.labels[index])
{% else %}
        with Image.open(io.BytesIO(self.read(index))) as file:
            image = file.convert("RGB")  # as torchvision's ImageFolder loads a file
        return image if self.transform is None else self.transform(image), int(self.labels[index])
{% endif %}


{% if cookiecutter.with_photos == "yes" %}
def shapes(
    root, split: str, transform=None, per_class: int = 600, image_size: int = 32, data_seed: int = 2026, decode="auto"
):
    """One split of the shapes data set, drawn into `root` on first use."""
    make_shapes(Path(root), per_class, image_size, data_seed)
    return ImageFiles(Path(root) / split, transform=transform, decode=decode)
{% else %}
def shapes(root, split: str, transform=None, per_class: int = 600, image_size: int = 32, data_seed: int = 2026):
    """One split of the shapes data set, drawn into `root` on first use."""
    make_shapes(Path(root), per_class, image_size, data_seed)
    return ImageFiles(Path(root) / split, transform=transform)
{% endif %}


def precheck_shapes(root, per_class: int = 600, image_size: int = 32, data_seed: int = 2026, **_) -> list[str]:
    """What `shapes()` would refuse, without drawing anything: a folder holding other shapes or other files."""
    make_shapes(Path(root), per_class, image_size, data_seed, draw=False)
    return sorted(SHAPES)  # the class folders, in ImageFolder's order


shapes.precheck = precheck_shapes  # preflight.precheck_data calls a target's `precheck` before Hydra writes anything


def make_shapes(root: Path, per_class: int, image_size: int, data_seed: int, masks: bool = False, draw: bool = True):
    """Draw the shapes into `root` once: PNG files in one folder per shape (ImageFolder's layout), or with `masks`
    each split's images/ and masks/ (SegmentationFolder's); both draw the same images.
    Concurrent callers (DDP ranks, parallel tests) race safely: the folder is built under a temporary name and
    renamed into place, so a reader never sees half of it. The recipe is stored beside the images (shapes.json)
    and checked on reuse: a folder drawn otherwise, or holding other files, is refused; with `masks`, a
    folder of image/mask pairs is your data, read as it is. `draw=False`: those refusals alone, nothing drawn
    (the prechecks)."""
    wanted = {"format": SHAPES_FORMAT, "per_class": per_class, "image_size": image_size, "data_seed": data_seed}
    if masks:
        wanted["layout"] = "segmentation"
    marker = root / "shapes.json"
    if marker.exists():
        if json.loads(marker.read_text()) != wanted:
            raise UserError(
                f"{str(root)!r} holds shapes drawn with other settings ({marker.read_text().strip()}): "
                "delete that folder or set data.root to a new one"
            )
        return
    # a split's images/ and masks/ folders (SegmentationFolder's layout): your own pairs, read as they are
    if masks and any((root / s / "images").is_dir() and (root / s / "masks").is_dir() for s in ("train", "val")):
        return
    if root.exists() and any(root.iterdir()):
        raise UserError(
            f"{str(root)!r} exists but is not a generated shapes folder: set data.root to an empty or new path"
            + (", or to a folder of <split>/images and <split>/masks pairs" if masks else "")
        )
    if not draw:
        return
    tmp = root.parent / f".{root.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    rng = np.random.default_rng(data_seed)
    for split, count in (("train", per_class), ("val", max(per_class // 5, 1))):
        for name in SHAPES:
            for i in range(count):
                image, mask = draw_shape(name, image_size, rng)
                files = {"images": image, "masks": mask} if masks else {name: image}
                for folder, picture in files.items():
                    path = tmp / split / folder / (f"{name}-{i:05d}.png" if masks else f"{i:05d}.png")
                    path.parent.mkdir(parents=True, exist_ok=True)
                    picture.save(path)
    (tmp / "shapes.json").write_text(json.dumps(wanted))
    try:
        os.rename(tmp, root)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
        if not marker.exists():
            raise


def draw_shape(name: str, size: int, rng: np.random.Generator) -> tuple[Image.Image, Image.Image]:
    """One noisy image of `name` (random colours, size, position and rotation) and its mask: the shape's pixels
    hold its class (1 + its index in SHAPES), the rest 0 (background), the shape's edge pixels IGNORE."""
    background = rng.integers(0, 256, 3)
    colour = (background + rng.integers(80, 176, 3)) % 256  # always far from the background
    pixels = np.clip(background + rng.normal(0, 12, (size, size, 3)), 0, 255).astype(np.uint8)
    image, mask = Image.fromarray(pixels, "RGB"), Image.new("L", (size, size), 0)
    radius = rng.uniform(0.2, 0.38) * size
    cx, cy = rng.uniform(radius, size - radius, 2)
    angle = rng.uniform(0, 2 * math.pi)
    fill = tuple(colour.tolist())  # plain ints, as PIL takes a colour
    for pen, paint in ((ImageDraw.Draw(image), fill), (ImageDraw.Draw(mask), 1 + SHAPES.index(name))):
        if name == "circle":
            pen.ellipse([cx - radius, cy - radius, cx + radius, cy + radius], fill=paint)
        elif name == "cross":
            arm = radius * 0.3  # two bars of this half-width, one across the other
            for a in (angle, angle + math.pi / 2):
                dx, dy = math.cos(a), math.sin(a)
                ax, ay, px, py = dx * radius, dy * radius, -dy * arm, dx * arm
                ends = ((1, 1), (1, -1), (-1, -1), (-1, 1))  # (along, across) signs of the bar's corners
                pen.polygon([(cx + s * ax + t * px, cy + s * ay + t * py) for s, t in ends], fill=paint)
        else:
            corners = 4 if name == "square" else 3
            turns = (angle + 2 * math.pi * k / corners for k in range(corners))
            pen.polygon([(cx + radius * math.cos(a), cy + radius * math.sin(a)) for a in turns], fill=paint)
    return image, Image.fromarray(ignore_edge(np.array(mask)), "L")


def ignore_edge(mask: np.ndarray) -> np.ndarray:
    """`mask` with the shape's pixels that touch the background (4-neighbours) set to IGNORE: a resized image blends
    the shape into the background there, and which class such a pixel holds is a matter of taste."""
    shape = mask > 0
    inside = np.pad(shape, 1, mode="edge")  # the image border is no edge
    core = shape & inside[:-2, 1:-1] & inside[2:, 1:-1] & inside[1:-1, :-2] & inside[1:-1, 2:]
    return np.where(shape & ~core, IGNORE, mask).astype(np.uint8)


class SegmentationFolder(torch.utils.data.Dataset):
    """Image/mask pairs: `<root>/<split>/images/<name>.<png|jpg>` and `<root>/<split>/masks/<name>.png`, a mask pixel
    holding its class index (0 .. num_classes - 1) or IGNORE (255: no class, left out of the loss and metrics). With
    `generate`, the shapes are drawn into `root` on first use (masks with class 1 + the shape's index in SHAPES, 0 the
    background); without it, the pairs are your own.

    A sample is `(image, mask)`: uint8 (3, H, W) and int64 (H, W). `transform` (torchvision.transforms.v2) gets both
    at once as `tv_tensors.Image` and `tv_tensors.Mask`, so a random crop or flip moves the mask with the image and
    a resize takes the mask's nearest pixel (no blended class indices). `num_classes`, when given, refuses a mask
    holding another value, naming the file, instead of an index error in the loss.
    """

    def __init__(
        self,
        root,
        split: str,
        transform=None,
        num_classes: int | None = None,
        generate: bool = False,
        per_class: int = 100,
        image_size: int = 32,
        data_seed: int = 2026,
    ):
        if generate:
            make_shapes(Path(root), per_class, image_size, data_seed, masks=True)
        self.images, self.masks = self.pairs(root, split)  # two arrays of paths
        self.transform, self.num_classes = transform, num_classes

    @staticmethod
    def precheck(
        root, split: str, generate: bool = False, per_class: int = 100, image_size: int = 32, data_seed: int = 2026, **_
    ) -> None:
        """What the constructor would refuse, without drawing anything: a folder in the way of the generated shapes,
        or your folder's layout. No class names to return: the masks' values are read with the samples."""
        if generate:
            make_shapes(Path(root), per_class, image_size, data_seed, masks=True, draw=False)
        else:
            SegmentationFolder.pairs(root, split)

    @staticmethod
    def pairs(root, split: str) -> np.ndarray:
        """The split's image paths and mask paths, an array (2, n); a missing piece is a UserError."""
        folder = Path(root) / split
        layout = f"{folder}/images/<name>.png|jpg and {folder}/masks/<name>.png"
        if not folder.is_dir():
            raise UserError(f"data folder {str(folder)!r} does not exist: point data.root at a folder holding {layout}")
        for sub in ("images", "masks"):
            if not (folder / sub).is_dir():
                raise UserError(f"no {sub}/ folder in {str(folder)!r}: segmentation data is laid out as {layout}")
        images = sorted(p for p in (folder / "images").iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        if not images:
            raise UserError(f"no .png or .jpg images in {str(folder / 'images')!r}: lay the data out as {layout}")
        masks = [folder / "masks" / f"{p.stem}.png" for p in images]
        missing = [str(m) for m in masks if not m.is_file()]
        if missing:
            raise UserError(
                f"{len(missing)} of the {len(images)} images in {str(folder / 'images')!r} have no mask "
                f"(first: {missing[0]!r}): give every image a mask of the same name, or take the image out"
            )
        return np.array([[str(p) for p in images], [str(p) for p in masks]])

    def __len__(self) -> int:
        return len(self.images)

    def sample_source(self, index: int) -> str:
        """Where sample `index` comes from, for the line that names a bad sample (engine/failures.py)."""
        return f"file {self.images[index]} (mask {self.masks[index]})"

    def __getitem__(self, index: int):
        with Image.open(self.images[index]) as file:
            image = tv_tensors.Image(pil_to_tensor(file.convert("RGB")))
        with Image.open(self.masks[index]) as file:
            if file.mode not in ("L", "P"):  # P: a palette PNG (VOC's), whose pixel values are the indices
                raise ValueError(f"mask mode {file.mode}: save masks as 8-bit single-channel PNGs (mode L or P)")
            mask = np.array(file)
        if mask.shape != tuple(image.shape[1:]):
            raise ValueError(f"mask of {mask.shape[1]}x{mask.shape[0]} pixels for an image of {image.shape[2]}x"
                             f"{image.shape[1]}: give them the same size")  # fmt: skip
        if self.num_classes is not None:
            odd = np.setdiff1d(np.unique(mask), [*range(self.num_classes), IGNORE])
            if odd.size:
                raise ValueError(
                    f"mask value {int(odd[0])}, but data.num_classes={self.num_classes} (classes 0 .. "
                    f"{self.num_classes - 1}, and {IGNORE} = ignore)"
                )
        mask = tv_tensors.Mask(torch.from_numpy(mask))
        if self.transform is not None:
            image, mask = self.transform(image, mask)
        # plain tensors out: the batch is then what any other data set gives, not tv_tensors
        return image.as_subclass(torch.Tensor), mask.as_subclass(torch.Tensor).long()


def cifar10(root, train: bool, transform=None, download: bool = False):
    """CIFAR-10 from a local `cifar-10-batches-py` folder; downloading stays off unless asked for."""
    precheck_cifar10(root, download)
    return datasets.CIFAR10(str(root), train=train, transform=transform, download=download)


def precheck_cifar10(root, download: bool = False, **_) -> None:
    """No local copy and no download asked for: refused before the run, and by `cifar10()` itself."""
    if not download and not (Path(root) / datasets.CIFAR10.base_folder).is_dir():
        raise UserError(
            f"no CIFAR-10 under {str(root)!r} (no {datasets.CIFAR10.base_folder} folder): copy cifar-10-batches-py "
            "there, or set data.download=true on a machine with internet"
        )


cifar10.precheck = precheck_cifar10
