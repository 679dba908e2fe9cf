"""What moves between the host and the device, and when: batches in, a few numbers out.

- `device_batches` copies each batch to the device; on CUDA on a side stream, overlapping the previous step's kernels.
- `Normalize` turns the uint8 images the workers ship into normalized floats, on the device: the workers, shared
  memory, pinned memory and the host-to-device copy then move 1 byte per pixel, not 4.
{% if cookiecutter.with_photos == "yes" %}
  `PrepareBatch` applies it to the model's input alone (`data.input`), never to masks or token ids. With
  data.decode=gpu the input arrives as JPEG files, which it first decodes there (decode.py's `EncodedBatch`).
{% else %}
  `PrepareBatch` applies it to the model's input alone (`data.input`), never to masks or token ids.
{% endif %}
- `sum_and_read` is the loop's only way back, one read of a few sums: on a GPU every read waits for the device to
  finish its queued work, so the loop calls it once per `log_every_steps` steps, per validation and per epoch.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch
from hydra.utils import instantiate

from . import distributed
from .errors import UserError


def pick_device(choice) -> torch.device:
    """The device for `device` (auto | cpu | cuda): under torchrun, this rank's GPU."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise UserError("device=cuda but no CUDA device is visible: use device=cpu or device=auto")
    if choice != "cpu" and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def _rebuilt(batch, fn):
    """`batch` (a dict, list or tuple) in its own type, with `fn(key or position, part)` in place of each part."""
    if isinstance(batch, Mapping):
        return type(batch)((k, fn(k, v)) for k, v in batch.items())
    parts = [fn(i, v) for i, v in enumerate(batch)]
    return type(batch)(*parts) if hasattr(batch, "_fields") else type(batch)(parts)  # a namedtuple: fields as args


def map_tensors(fn, batch):
    """`batch` with `fn` applied to every tensor in it, however nested in tuples, lists and dicts."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, (Mapping, list, tuple)):
        return _rebuilt(batch, lambda _, part: map_tensors(fn, part))
    return batch


def tensors(batch) -> list[torch.Tensor]:
    """Every tensor in `batch`, in order (map_tensors' walk; the rebuilt batch it returns is dropped)."""
    found = []
    map_tensors(found.append, batch)
    return found


def has_part(batch, key: int | str) -> bool:
    """Whether `key` (data.input) names a part of `batch`: a position in a tuple or list, or a key of a dict."""
    if isinstance(batch, Mapping):
        return key in batch
    return isinstance(batch, (list, tuple)) and isinstance(key, int) and key < len(batch)


def to_device(batch, device: torch.device, non_blocking: bool = True):
    """The batch with every tensor on `device`, however nested in tuples, lists and dicts."""
    return map_tensors(lambda t: t.to(device, non_blocking=non_blocking), batch)


class device_batches:  # noqa: N801 (used like a function: `for batch in device_batches(loader, device)`)
    """Iterate `loader` with its batches on `device`.

    Batch i+1 is taken from the loader only when the loop asks for it, after step i's work is queued: which batch
    the loop consumes when, and so the loader state a checkpoint records, stay exactly what they are without this
    class. On CUDA the copy of batch i+1 is issued on a side stream at that moment; the GPU runs it while it still
    computes step i (the host is ahead of it), and the compute stream waits for the copy only before step i+1's
    first kernel (`wait_stream`). The copies are allocated on the side stream and used on the compute stream:
    `record_stream` keeps the allocator from handing that memory out again before the compute stream is done with
    it. Only pinned host memory copies asynchronously, which is why `loader.pin_memory` is on for CUDA by default.
    """

    def __init__(self, loader: Iterable, device: torch.device, overlap: bool = True):
        self.loader, self.device = loader, device
        self.stream = torch.cuda.Stream(device) if overlap and device.type == "cuda" else None

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator:
        for batch in self.loader:
            if self.device.type == "cpu":
                yield batch  # already where the model is
            elif self.stream is None:
                yield to_device(batch, self.device)
            else:
                compute = torch.cuda.current_stream(self.device)
                with torch.cuda.stream(self.stream):
                    moved = to_device(batch, self.device)
                compute.wait_stream(self.stream)
                for t in tensors(moved):
                    t.record_stream(compute)
                yield moved


class Normalize:
    """uint8 images (N, C, H, W) in, float32 `(x / 255 - mean) / std` out, computed on the device.

    Float input is taken as already prepared by its dataset and passes through: a data set of your own that
    returns normalized float tensors keeps working unchanged. With `channels_last` the output is laid out
    NHWC, the layout the model was converted to.
    """

    def __init__(
        self,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        device: torch.device | str = "cpu",
        channels_last: bool = False,
    ):
        self.mean, self.std = (
            None if v is None else torch.tensor(list(v), dtype=torch.float32, device=device).view(1, -1, 1, 1)
            for v in (mean, std)
        )
        self.channels_last = channels_last

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.uint8:
            x = x.float().div_(255)
            if self.mean is not None:
                x.sub_(self.mean)
            if self.std is not None:
                x.div_(self.std)
        if self.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return x


def sum_and_read(values: Sequence, device: torch.device, world=None) -> list[float]:
    """Sum `values` (device tensors and plain numbers) over ranks in one all-reduce, then read them: one host read.
    A tensor of several elements (a metric's per-class sums) gives its elements, flattened, in its place."""
    parts = [torch.as_tensor(v, dtype=torch.float64).detach().reshape(-1).to(device, non_blocking=True) for v in values]
    return distributed.all_reduce(torch.cat(parts), world)


AMP = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def amp_dtype(value, device: torch.device):
    """The autocast dtype for `amp`, or None for float32: fp16 needs a GradScaler
    and is for CUDA only, ignored on the CPU (the caller says so)."""
    dtype = AMP[value]  # the schema refused any other value
    return None if dtype is torch.float16 and device.type != "cuda" else dtype


class PrepareBatch:
    """The data's device-side transform (`data.normalize`) applied to the model's input alone.

    `data.input` names the input: a position in a tuple or list batch (`0` for `(image, label)`), or a key of a
    dict batch (`image`); a batch that is one tensor is the input. Every other part of the batch (labels, masks,
{% if cookiecutter.with_photos == "yes" %}
    token ids, attention masks) passes untouched, whatever its dtype or rank: a uint8 (N, 1, H, W) mask stays a mask.
    An input that is not images yet says how to become them on `device` (`to_images`): data.decode=gpu's JPEG files,
    still on the host (decode.EncodedBatch, known by that method alone: this module imports no torchvision).
{% else %}
    token ids, attention masks) passes untouched, whatever its dtype or rank: a uint8 (N, 1, H, W) mask stays a mask.
{% endif %}

    `needed_by`: the keys set that work on the input, named when `data.input` names no part of the batch. `stage(key)`
    is around each stage: the dry step's (parts.stage) turns an error there into a line naming that key.
    """

    def __init__(
        self, normalize, input_key: int | str = 0, device: torch.device | str = "cpu", needed_by=("data.normalize",)
    ):
        self.normalize, self.input, self.device = normalize, input_key, torch.device(device)
        self.needed_by = tuple(needed_by)

    def prepared(self, part, stage):
{% if cookiecutter.with_photos == "yes" %}
        with stage("data.decode"):
            if hasattr(part, "to_images"):
                part = part.to_images(self.device)
{% endif %}
        with stage("data.normalize"):
            return map_tensors(self.normalize, part)

    def __call__(self, batch, stage=contextlib.nullcontext):
{% if cookiecutter.with_photos == "yes" %}
        if isinstance(batch, torch.Tensor) or hasattr(batch, "to_images"):
{% else %}
        if isinstance(batch, torch.Tensor):
{% endif %}
            return self.prepared(batch, stage)
        key = self.input
        if has_part(batch, key):
            return _rebuilt(batch, lambda k, part: self.prepared(part, stage) if k == key else part)
        if not self.needed_by:  # nothing set works on the input: every (N, C, H, W) tensor scaled to [0, 1]
            with stage("data.normalize"):
                return map_tensors(lambda t: self.normalize(t) if t.dim() == 4 else t, batch)
        has = f" with {len(batch)} parts" if isinstance(batch, (list, tuple)) else ""
        has = f" with keys {', '.join(map(str, batch))}" if isinstance(batch, Mapping) else has
        users = ", ".join(self.needed_by)
        raise UserError(
            f"data.input={key!r} is not in the batch (a {type(batch).__name__}{has}): set data.input to the "
            f"position or key of the model's input, the part {users} {'work' if ',' in users else 'works'} on"
        )


def input_transform(data_cfg, device: torch.device, channels_last: bool = False) -> PrepareBatch:
    """`data.normalize` (a Hydra `_target_`; without one uint8 images are only scaled to [0, 1]) built on `device` for
    the input `data.input` names (0 when absent), which must name a part of the batch only where something set works on
{% if cookiecutter.with_photos == "yes" %}
    the input (`users`: MixUp needs float images). data.decode=gpu decodes there too, refused off CUDA."""
    node, key = data_cfg.get("normalize"), data_cfg.get("input", 0)
    if data_cfg.get("decode") == "gpu" and device.type != "cuda":
        raise UserError(
            f"data.decode=gpu decodes each batch with nvJPEG on the training device, and this run trains on "
            f"{device.type}: use data.decode=auto, or device=cuda"
        )
{% else %}
    the input (`users`: MixUp needs float images)."""
    node, key = data_cfg.get("normalize"), data_cfg.get("input", 0)
{% endif %}
    users = {
        "data.normalize": node is not None,
        "channels_last": channels_last,
        "data.batch_transform": data_cfg.get("batch_transform") is not None,
{% if cookiecutter.with_photos == "yes" %}
        "data.decode=gpu": data_cfg.get("decode") == "gpu",
{% endif %}
    }
    needed_by = [name for name, used in users.items() if used]
    build = Normalize if node is None else lambda **kwargs: instantiate(node, **kwargs)
    return PrepareBatch(build(device=device, channels_last=channels_last), key, device, needed_by)
