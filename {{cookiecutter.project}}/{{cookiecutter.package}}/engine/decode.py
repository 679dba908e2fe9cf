"""data.decode: an image file's bytes decoded only as far as the transform's first crop needs (`CropDecoder`), the
crop's box drawn first with the transform's own draws; the data sets of data.py and shards.py read their files so.

data.decode=gpu: a worker sends a JPEG as its bytes with the crop's box and the flip it drew (`EncodedImage`), from the
sample's seeded generator with the CPU path's draws, so the run is deterministic, exact on resume and the same for any
worker count. The data set's collate (`CropDecoder.collate`) keeps a batch's files in one buffer (`EncodedBatch`: they
do not stack), which `device.to_device` leaves on the host, where nvJPEG reads its input, and does not pin (the
prefetch plan counts a pinned copy of every batch: once too often here). `device.PrepareBatch` then decodes it on the
device (`to_images`) before data.normalize: with nvJPEG on CUDA; on the CPU (tests) with libjpeg-turbo, to the bit
what data.decode=torchvision makes.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import torch
from PIL import Image
from torch.utils.data import default_collate, get_worker_info
from torchvision import tv_tensors
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import v2
from torchvision.transforms.v2.functional import pil_to_tensor, resize

from .errors import UserError
from .schema import DECODERS, one_of

JPEG_FORMATS = ("JPEG", "MPO")  # MPO: a camera's JPEG with extra pictures after the first, which PIL opens as frame 0
SCALES = (8, 4, 2)  # the DCT scales libjpeg-turbo decodes at through PIL's Image.draft (1/8, 1/4, 1/2), largest first


class RandomBox:
    """A `v2.RandomResizedCrop`'s box, drawn before the file is decoded: its own `make_params` on the unopened image
    (PIL reads the size from the header), so the same draws from the same generator state as the transform."""

    def __init__(self, step: v2.RandomResizedCrop):
        self.step, self.size = step, list(step.size)
        self.interpolation, self.antialias = step.interpolation, step.antialias

    def box(self, image: Image.Image) -> tuple[float, float, float, float]:
        params = self.step.make_params([image])
        return params["top"], params["left"], params["height"], params["width"]


class CentreBox:
    """`v2.Resize(short side)` then `v2.CenterCrop`: the part of the image they keep, in the image's own pixels."""

    def __init__(self, resize: v2.Resize, centre: v2.CenterCrop):
        self.short, self.size = resize.size[0], list(centre.size)
        self.interpolation, self.antialias = resize.interpolation, resize.antialias

    def box(self, image: Image.Image) -> tuple[float, float, float, float] | None:
        (width, height), short = image.size, self.short
        # the resized size as torchvision's Resize computes it: the short side to `short`, the long one truncated
        if width <= height:
            new_w, new_h = short, int(short * height / width)
        else:
            new_w, new_h = int(short * width / height), short
        crop_h, crop_w = self.size
        if crop_h > new_h or crop_w > new_w:
            return None  # CenterCrop would pad: the whole transform runs, as without data.decode
        top, left = round((new_h - crop_h) / 2), round((new_w - crop_w) / 2)  # CenterCrop's (round gives an int)
        fy, fx = height / new_h, width / new_w
        return top * fy, left * fx, crop_h * fy, crop_w * fx


def crop_plan(transform):
    """(the box of the crop the transform starts with, the steps after it), for a `v2.Compose` of `ToImage` then
    `RandomResizedCrop`, or `ToImage`, `Resize(short side)`, `CenterCrop` (the shipped train and val lists); None
    for any other transform, which then gets the whole image as ImageFolder gives it. Exact types, not subclasses:
    a subclass of yours may crop otherwise (and before torchvision 0.21 a random crop is not drawn ahead)."""
    steps = list(transform.transforms) if type(transform) is v2.Compose else []
    types = [type(t) for t in steps]
    public = hasattr(v2.RandomResizedCrop, "make_params")  # torchvision >= 0.21; before, its draws were private
    if public and types[:2] == [v2.ToImage, v2.RandomResizedCrop]:
        return RandomBox(steps[1]), steps[2:]
    if types[:3] == [v2.ToImage, v2.Resize, v2.CenterCrop]:
        if steps[1].size is not None and len(steps[1].size) == 1 and steps[1].max_size is None:
            return CentreBox(steps[1], steps[2]), steps[3:]
    return None


class CropDecoder:
    """An image file's bytes -> `transform(image)`, decoding only what the transform's first crop keeps.

    `decode=pil`: PIL decodes the whole file and `convert("RGB")`s it, then the whole transform runs (ImageFolder's
    way). Otherwise, for a JPEG (a camera's MPO too) and a transform `crop_plan` knows: the crop's box is drawn
    first (the same draws the transform makes, from the same generator), then the file is decoded at the smallest
    DCT scale (1/2, 1/4, 1/8: libjpeg-turbo through PIL's `Image.draft`) whose image still holds the box at the
    output size or more, and the box is cut and resized from that (`auto`); or decoded whole by libjpeg-turbo
    through torchvision.io (`torchvision`, and `auto` when no smaller scale holds the box: faster than PIL at full
    size). The steps after the crop (the flip) then run as before. A CMYK JPEG decodes through PIL (torchvision
    converts CMYK otherwise); PNG and the rest go as with `pil`: PIL's `convert("RGB")` of grayscale, CMYK, 16-bit
    PNG is what comes out, and EXIF orientation is not applied (ImageFolder does not apply it either). A file that
    does not decode raises PIL's error, as with `pil`, for `data.on_bad_sample`.

    `decode=gpu`: an RGB or grayscale JPEG is not decoded here. Its box is drawn as above and its flip as
    `RandomHorizontalFlip` draws it, and the sample is the file's bytes with them (an `EncodedImage`), for the
    main process to decode with nvJPEG; every other file is decoded here as with `auto`. The transform must then
    be one the device can finish: see `gpu_steps`.
    """

    def __init__(self, transform, decode: str = "auto"):
        if wanted := one_of(*DECODERS)(decode):  # from code outside Hydra: the schema refuses it in a config
            raise UserError(f"data.decode must be {wanted}, got {decode!r}")
        self.transform, self.decode = transform, decode
        self.plan = None if decode == "pil" or transform is None else crop_plan(transform)
        self.flip = gpu_steps(transform, self.plan) if decode == "gpu" else None  # the flip step, if any
        self.collate_fn = self.collate if decode == "gpu" else None  # the data set's, for parts.collate

    def __call__(self, data: bytes):
        with Image.open(io.BytesIO(data)) as image:
            crop, rest = self.plan or (None, [])
            box = crop.box(image) if crop is not None and image.format in JPEG_FORMATS else None
            if box is None:  # the whole file, as torchvision's ImageFolder loads it, and the whole transform
                image = image.convert("RGB")
                return image if self.transform is None else self.transform(image)
            if self.decode == "gpu" and image.format == "JPEG" and image.mode in ("RGB", "L"):
                # the box as the CPU path cuts it at full size, the flip drawn after it as RandomHorizontalFlip draws
                # it (`torch.rand(1) >= p`: not flipped)
                flip = self.flip is not None and bool(torch.rand(1) < self.flip.p)
                return EncodedImage(torch.frombuffer(bytearray(data), dtype=torch.uint8), cut(box, 1, image.size), flip)
            pixels = self.region(data, image, box, crop.size)
        out = resize(pixels, crop.size, crop.interpolation, antialias=crop.antialias)  # resized_crop's own resize
        out = tv_tensors.Image(out.contiguous())  # what ToImage + the crop hand on: a (C, H, W) uint8 Image
        for step in rest:
            out = step(out)
        return out

    def region(self, data: bytes, image: Image.Image, box, size) -> torch.Tensor:
        """The box's pixels as a (3, h, w) uint8 tensor, decoded at scale 1, 2, 4 or 8 (h and w say which)."""
        _, _, height, width = box
        fits = (s for s in SCALES if height / s >= size[0] and width / s >= size[1])
        scale = 1 if self.decode == "torchvision" else next(fits, 1)  # torchvision: decoded whole
        if image.mode in ("RGB", "L") and scale == 1:
            try:
                pixels = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
            except RuntimeError:
                pass  # PIL decodes it below and raises its own words for a broken file, as with data.decode=pil
            else:
                y0, x0, y1, x1 = cut(box, 1, image.size)
                return pixels[:, y0:y1, x0:x1]  # the view RandomResizedCrop's own crop takes
        if scale > 1 and image.draft(image.mode, (image.width // scale, image.height // scale)) is None:
            scale = 1  # PIL could not draft this file: decoded whole
        y0, x0, y1, x1 = cut(box, scale, image.size)  # the size after the draft: the scaled image's
        # cut before the conversion to a tensor, which copies every pixel it is given (for a whole 1/4-scale decode
        # of a 2,048 x 1,536 photo, a fifth of the decode's own time); an RGB file is not converted: convert("RGB")
        # would only copy it again
        part = image.crop((x0, y0, x1, y1))
        return pil_to_tensor(part if part.mode == "RGB" else part.convert("RGB"))

    def collate(self, samples: list) -> list:
        """data.decode=gpu's collate of `(image, label)` samples: the images become one `EncodedBatch`; the labels,
        and images without a JPEG for the device (all PNG), go through default_collate, as a list."""
        return [self.join(list(column)) for column in zip(*samples, strict=True)]

    def join(self, images: list):
        """One `EncodedBatch` of a batch's images, files and worker-decoded ones mixed. In a worker its two buffers
        go to shared memory here, inside the fetch, as `loader.CollateWithSnapshot` moves a batch's other tensors: a
        full /dev/shm then fails as an error the main process receives, not in the worker queue's feeder thread."""
        at = [i for i, x in enumerate(images) if isinstance(x, EncodedImage)]
        if not at:
            return default_collate(images)
        files = [images[i] for i in at]
        data = torch.cat([f.data for f in files])
        others = [torch.as_tensor(x) for x in images if not isinstance(x, EncodedImage)]
        pixels = torch.stack(others).as_subclass(torch.Tensor) if others else None
        if get_worker_info() is not None:
            for t in (data, pixels):
                if t is not None:
                    t.share_memory_()
        lengths, boxes, flips = [f.data.numel() for f in files], [f.box for f in files], [f.flip for f in files]
        return EncodedBatch(data, lengths, boxes, flips, at, self.plan[0], pixels, len(images))


def gpu_steps(transform, plan):
    """data.decode=gpu's check of the transform: `crop_plan`'s crop, then nothing or one `RandomHorizontalFlip`
    (what the device does after the decode: crop, resize, flip); that flip, or None. Anything else is refused in
    one line: a step of another kind would run in the main process, off the sample's seeded generator."""
    if plan is not None and [type(t) for t in plan[1]] in ([], [v2.RandomHorizontalFlip]):
        return next(iter(plan[1]), None)
    steps = transform.transforms if type(transform) is v2.Compose else [transform]
    names = "none" if transform is None else ", ".join(type(t).__name__ for t in steps)
    raise UserError(
        "data.decode=gpu decodes, crops, resizes and flips on the device: the transform must be ToImage, "
        "RandomResizedCrop (torchvision 0.21 or later) and optionally RandomHorizontalFlip, or ToImage, Resize (one "
        f"number) and CenterCrop; this one is {names}: use data.decode=auto for it"
    )


def cut(box, scale: int, size: tuple[int, int]) -> tuple[int, int, int, int]:
    """(top, left, bottom, right) of `box` (top, left, height, width in the file's pixels) in the image decoded at
    1/`scale`, of `size` = (width, height) pixels: to the nearest pixel (a decoded pixel is `scale` of the file's),
    at least one pixel, inside the image. At scale 1, RandomResizedCrop's box as it is."""
    top, left, height, width = box
    y0, x0 = min(round(top / scale), size[1] - 1), min(round(left / scale), size[0] - 1)
    y1 = max(y0 + 1, min(size[1], round((top + height) / scale)))
    x1 = max(x0 + 1, min(size[0], round((left + width) / scale)))
    return y0, x0, y1, x1


@dataclass
class EncodedImage:
    """One JPEG sample as a worker makes it: the file's bytes (uint8, 1-D), its box (`cut`'s top, left, bottom,
    right, in the file's pixels) and whether it is flipped."""

    data: torch.Tensor
    box: tuple[int, int, int, int]
    flip: bool


@dataclass
class EncodedBatch:
    """A batch's images on the host: the JPEG files one after the other in `data` (`lengths`: how many bytes
    each), with their boxes, flips and places in the batch (`at`), and the crop step's box
    (`RandomBox` or `CentreBox`: the size, interpolation and antialias every box is resized with); `pixels` holds
    the images a worker decoded itself, stacked (uint8 (M, 3, H, W)), for the other places, or is None."""

    data: torch.Tensor
    lengths: list[int]
    boxes: list[tuple[int, int, int, int]]
    flips: list[bool]
    at: list[int]
    crop: RandomBox | CentreBox
    pixels: torch.Tensor | None
    size: int  # images in the batch

    def __len__(self) -> int:
        return self.size

    @property
    def nbytes(self) -> int:
        """What the batch holds in memory (the prefetch plan counts it): the files and the decoded images."""
        return self.data.nbytes + (0 if self.pixels is None else self.pixels.nbytes)

    def describe(self) -> str:
        """`60 JPEG files 5.12 MiB + 4x3x64x64 uint8`: the batch for the prefetch plan's log line."""
        text = f"{len(self.at)} JPEG files {self.data.nbytes / 2**20:.2f} MiB"
        return text if self.pixels is None else f"{text} + {'x'.join(map(str, self.pixels.shape))} uint8"

    def to_images(self, device: torch.device) -> torch.Tensor:
        """The batch as uint8 (N, 3, H, W) on `device`: the files decoded there in one call (nvJPEG on CUDA), each
        box cut, resized by the resize the CPU path uses and flipped where drawn, the worker-decoded images copied
        into their places."""
        crop = self.crop
        out = torch.empty((self.size, 3, *crop.size), dtype=torch.uint8, device=device)
        try:
            # the files, each a 1-D view of `data`, decoded in one call
            images = decode_jpeg(list(self.data.split(self.lengths)), mode=ImageReadMode.RGB, device=device)
        except torch.cuda.OutOfMemoryError:
            raise
        except RuntimeError as e:  # a file that passed PIL's header read but not the decoder, for the whole batch
            raise UserError(
                f"data.decode=gpu: a JPEG file of this batch does not decode on {device} ({str(e).splitlines()[0]}):"
                " data.decode=auto decodes in the workers, where data.on_bad_sample names the file or skips it"
            ) from None
        for place, image, (y0, x0, y1, x1), flip in zip(self.at, images, self.boxes, self.flips, strict=True):
            part = image[:, y0:y1, x0:x1]  # the view the CPU path cuts
            part = resize(part, crop.size, crop.interpolation, antialias=crop.antialias)
            out[place] = part.flip(-1) if flip else part  # RandomHorizontalFlip's own flip of an image
        if self.pixels is not None:
            encoded = set(self.at)
            out[[i for i in range(self.size) if i not in encoded]] = self.pixels.to(device)
        return out
