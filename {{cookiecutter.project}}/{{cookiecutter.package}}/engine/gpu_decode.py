"""data.decode=gpu: the loader's workers read each JPEG file's bytes and draw its crop; the main process decodes each
batch with nvJPEG on the device, after the batch's copy, and crops, resizes and flips it there.

- In a worker, decode.py's `CropDecoder` makes a JPEG sample an `EncodedImage`: the file's bytes as a uint8 tensor,
  and the box of its crop and its flip, drawn from the sample's seeded generator with the draws the CPU decoders
  make (the crop's own `make_params`, then `RandomHorizontalFlip`'s `torch.rand(1)`). So a sample draws what it
  draws with data.decode=auto: the run is deterministic, exact on resume and the same for any worker count. A file
  the worker decodes itself (PNG and the other formats, a CMYK or MPO JPEG) comes as pixels, as with `auto`.
- `collate`, which a data set with data.decode=gpu names as its `collate_fn` (parts.collate takes it from
  there): files of different lengths do not stack, so a batch's images become one `EncodedBatch`, a list of files
  kept in one buffer (in a worker, one shared-memory file for the batch rather than one per image); the labels go
  through default_collate.
- An `EncodedBatch` is neither a tensor nor a container to `device.to_device`: it stays on the host, where nvJPEG
  reads its input (torchvision.io.decode_jpeg takes CPU tensors only). Nor is it pinned (the pin-memory thread pins
  tensors): the prefetch plan, which counts a pinned copy of every batch, counts it once too often.
  `device.PrepareBatch` calls its `to_images(device)` before data.normalize: one batched decode_jpeg call, then each
  image's box resized to the output size by the resize the CPU path uses, flipped where drawn, all stacked into a
  uint8 (N, 3, H, W) batch. On the CPU (tests) decode_jpeg decodes the list with libjpeg-turbo instead, and the
  batch comes out to the bit as data.decode=torchvision makes it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch.utils.data import default_collate, get_worker_info
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2.functional import resize

from .errors import UserError


@dataclass(frozen=True)
class Crop:
    """What every box of a batch is resized to: the crop step's (height, width), interpolation and antialias."""

    size: tuple[int, int]
    interpolation: InterpolationMode
    antialias: bool | None


@dataclass
class EncodedImage:
    """One JPEG sample as a worker makes it: the file's bytes (uint8, 1-D), its box (top, left, height, width, in
    the file's pixels), whether it is flipped, and the crop it is resized as."""

    data: torch.Tensor
    box: tuple[int, int, int, int]
    flip: bool
    crop: Crop


@dataclass
class EncodedBatch:
    """A batch's images on the host: the JPEG files one after the other in `data` (file k is
    `data[ends[k - 1]:ends[k]]`), with their boxes, flips and places in the batch (`at`); `pixels` holds the images
    a worker decoded itself, stacked (uint8 (M, 3, H, W)), for the other places, or is None."""

    data: torch.Tensor
    ends: list[int]
    boxes: list[tuple[int, int, int, int]]
    flips: list[bool]
    at: list[int]
    crop: Crop
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
        return text if self.pixels is None else text + " + " + "x".join(map(str, self.pixels.shape)) + " uint8"

    def files(self) -> list[torch.Tensor]:
        """The JPEG files, each a 1-D view of `data`: the list decode_jpeg decodes in one call."""
        return [self.data[a:b] for a, b in zip([0, *self.ends[:-1]], self.ends, strict=True)]

    def to_images(self, device: torch.device) -> torch.Tensor:
        """The batch as uint8 (N, 3, H, W) on `device`: the files decoded there in one call (nvJPEG on CUDA), each
        box cut, resized and flipped, the worker-decoded images copied into their places."""
        out = torch.empty((self.size, 3, *self.crop.size), dtype=torch.uint8, device=device)
        try:
            images = decode_jpeg(self.files(), mode=ImageReadMode.RGB, device=device)
        except torch.cuda.OutOfMemoryError:
            raise
        except RuntimeError as e:  # a file that passed PIL's header read but not the decoder, for the whole batch
            raise UserError(
                f"data.decode=gpu: a JPEG file of this batch does not decode on {device} ({str(e).splitlines()[0]}):"
                " data.decode=auto decodes in the workers, where data.on_bad_sample names the file or skips it"
            ) from None
        size = list(self.crop.size)
        for place, image, (top, left, height, width), flip in zip(self.at, images, self.boxes, self.flips, strict=True):
            part = image[:, top : top + height, left : left + width]  # the view the CPU path cuts
            part = resize(part, size, self.crop.interpolation, antialias=self.crop.antialias)
            out[place] = part.flip(-1) if flip else part  # RandomHorizontalFlip's own flip of an image
        if self.pixels is not None:
            encoded = set(self.at)
            out[[i for i in range(self.size) if i not in encoded]] = self.pixels.to(device)
        return out


def collate(samples: list):
    """data.decode=gpu's collate: the part of the samples that holds `EncodedImage`s (the image of `(image,
    label)`) becomes one `EncodedBatch`, kept as a list of files, nothing stacked; every other part goes through
    default_collate, and the parts come as a list, as default_collate gives them. A batch without a JPEG for the
    device (all PNG) is default_collate's batch as it is."""
    if not isinstance(samples[0], (tuple, list)):
        return join(samples) if encoded(samples) else default_collate(samples)
    columns = [list(column) for column in zip(*samples, strict=True)]
    return [join(column) if encoded(column) else default_collate(column) for column in columns]


def encoded(column: list) -> bool:
    return any(isinstance(x, EncodedImage) for x in column)


def join(images: list) -> EncodedBatch:
    """One `EncodedBatch` of a batch's images, files and worker-decoded ones mixed. In a worker its two buffers go
    to shared memory here, inside the fetch, as `loader.CollateWithSnapshot` moves a batch's other tensors: a full
    /dev/shm then fails as an error the main process receives, not in the worker queue's feeder thread."""
    at = [i for i, x in enumerate(images) if isinstance(x, EncodedImage)]
    files = [images[i] for i in at]
    crops = {f.crop for f in files}
    if len(crops) > 1:
        raise ValueError(f"data.decode=gpu: the samples of one batch are cropped to {len(crops)} different sizes")
    data = torch.cat([f.data for f in files])
    others = [torch.as_tensor(x) for x in images if not isinstance(x, EncodedImage)]
    pixels = torch.stack(others).as_subclass(torch.Tensor) if others else None
    if get_worker_info() is not None:
        for t in (data, pixels):
            if t is not None:
                t.share_memory_()
    ends = list(itertools.accumulate(f.data.numel() for f in files))
    boxes, flips = [f.box for f in files], [f.flip for f in files]
    return EncodedBatch(data, ends, boxes, flips, at, crops.pop(), pixels, len(images))
