"""The prefetch memory plan: how many bytes of batches the train loader holds in flight, and a budget for it.

Each worker keeps up to `prefetch_factor` batches ahead of the loop (torch/utils/data/dataloader.py keeps that many
indices outstanding per worker), each in a shared-memory file until the loop lets go of it; with pinning, the
pin-memory thread copies each into page-locked memory that PyTorch's caching host allocator keeps for reuse. What
the plan leaves out (the workers' dataset copies, decode buffers...): docs/loader.md.

    prefetch bytes = bytes of one batch x num_workers x prefetch_factor x (2 when pinned, else 1)

/dev/shm. On Linux every batch a worker hands over is a file in /dev/shm (a tmpfs; torch's shared memory), and
containers get 64 MiB of it unless told otherwise (`docker run --shm-size`). A batch that does not fit fails in the
worker, mid-run (failures.shm_full; pytorch/pytorch#5040). So before any worker starts, `fit` holds what the loaders
of every rank on this host will put there (`shm_need`) against its free space, and lowers the profile or refuses.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

from torch.utils.data import default_collate

from . import rng{% if cookiecutter.with_streams == "yes" %}, shard_plan{% endif +%}
from .errors import UserError
from .failures import SHM_DIR, shm_space
from .loader import LoaderSettings

MiB = 2**20
# Beyond the batches counted in shm_need: tmpfs rounds every tensor file up to whole pages (a label
# tensor of 512 bytes takes 4 KiB), and a batch of the validation set may be larger than a train batch.
SHM_MARGIN = 1.25


def leaves(batch, key=None):
    """(its dict key or None, leaf) for every tensor and numpy array{% if cookiecutter.with_photos == "yes" %} (and decode.EncodedBatch){% endif %} in a batch, however
    nested in tuples, lists and dicts. Strings, ints and other Python objects are left out: small next to the
    tensors, and not in shared memory."""
    if isinstance(batch, Mapping):
        for k, v in batch.items():
            yield from leaves(v, k)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            yield from leaves(v, key)
    elif isinstance(getattr(batch, "nbytes", None), int):  # each of those has its size in bytes, torch's tensors too
        yield key, batch


def batch_bytes(batch) -> int:
    """Bytes of every tensor (and numpy array) in a batch."""
    return sum(v.nbytes for _, v in leaves(batch))


LISTED = 4  # tensors the plan line names one by one; more are counted


def layout(batch) -> str:
    """`64x3x32x32 float32, 64 int64` (`image: ...` in a dict): the tensors of a batch, for the log line; more than
    LISTED counted, e.g. `24 tensors: 8 x 3x6-8x6-8 float32, boxes: 8 x 1-3x4 float32, labels: 8 x 1-3 int64`."""

    def describe(v) -> str:
{% if cookiecutter.with_photos == "yes" %}
        if hasattr(v, "describe"):  # data.decode=gpu's JPEG files: `60 JPEG files 5.12 MiB + 4x3x64x64 uint8`
            return v.describe()
{% endif %}
        return "x".join(map(str, v.shape)) + " " + str(v.dtype).removeprefix("torch.")

    def named(k, vs: list) -> str:  # `k: ` and one tensor, or several counted: each size's range
        text = describe(vs[0])
        if len(vs) > 1:
            sizes = ((min(d), max(d)) for d in zip(*(v.shape for v in vs)))
            shape = "x".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in sizes)
            text = f"{len(vs)} x {shape} {text.split(' ', 1)[-1]}"
        return (f"{k}: " if k is not None else "") + text

    found = [(k, v) for k, v in leaves(batch) if v.nbytes]
    if len(found) <= LISTED:
        return ", ".join(named(k, [v]) for k, v in found)
    # a tensor a sample (a detection batch's images and targets): counted by key, dtype and rank
    kinds = {}
    for k, v in found:
        kinds.setdefault((k, getattr(v, "dtype", None), len(getattr(v, "shape", ()))), []).append(v)
    return f"{len(found)} tensors: " + ", ".join(named(k, vs) for (k, _, _), vs in kinds.items())


def sample_batch_bytes(dataset, batch_size: int, collate_fn=default_collate) -> int:
    """Bytes of one batch, before any worker exists: sample 0{% if cookiecutter.with_streams == "yes" %} (a stream's first record){% endif %} collated once, times
    `batch_size` (for variable-size samples: a batch of sample 0's). Fetched in the main process with the main RNG
    put back after (the run is the same with or without a budget), from a shallow copy (a dataset that opens its
    files lazily does so on the copy, and the workers inherit no open handles)."""
    with rng.kept(cuda=False):
{% if cookiecutter.with_streams == "yes" %}
        streamed = shard_plan.is_stream(dataset)
        one = collate_fn(shard_plan.first_records(dataset, 1) if streamed else [copy.copy(dataset)[0]])
{% else %}
        one = collate_fn([copy.copy(dataset)[0]])
{% endif %}
    return batch_bytes(one) * batch_size


@dataclass(frozen=True)
class Plan:
    """What a loader profile holds in flight (the prefetch plan) and in /dev/shm, for batches of `batch_bytes`."""

    settings: LoaderSettings
    batch_bytes: int
    layout: str = ""  # the tensors of a real batch, for the line

    @property
    def in_flight(self) -> int:
        """Batches made ahead of the loop: num_workers x prefetch_factor (0 when the main process loads)."""
        return self.settings.num_workers * (self.settings.prefetch_factor or 0)

    @property
    def pinned_copies(self) -> int:
        return self.in_flight if self.settings.pin_memory else 0

    @property
    def bytes(self) -> int:
        return self.batch_bytes * (self.in_flight + self.pinned_copies)

    @property
    def mib(self) -> float:
        return self.bytes / MiB

    @property
    def shm_batches(self) -> int:
        """Batches one rank's loaders can hold in /dev/shm at once: the plan's (pinned copies included), the batch
        in training, and with persistent workers the validation loader's queue on top: validation runs while the
        train workers already hold the next epoch's first batches (TrainLoader.start_next_epoch)."""
        if not self.settings.num_workers:
            return 0  # the main process loads: nothing goes through shared memory
        validation = self.in_flight if self.settings.persistent_workers else 0
        return self.in_flight + self.pinned_copies + validation + 1

    def shm_need(self, ranks: int = 1) -> int:
        """Bytes the loaders of `ranks` processes on this host can hold in /dev/shm, with SHM_MARGIN."""
        return int(self.shm_batches * self.batch_bytes * ranks * SHM_MARGIN)

    def line(self) -> str:
        """The log line: one batch's bytes and layout, the batches in flight, and /dev/shm's room for them."""
        s = self.settings
        what = f" ({self.layout})" if self.layout else ""
        head = f"prefetch plan: one batch {self.batch_bytes / MiB:.2f} MiB{what}"
        if not s.num_workers:
            return f"{head}; num_workers=0 loads in the main process: 0 batches in flight = 0.0 MiB"
        pinned = f" + {self.pinned_copies} pinned copies" if s.pin_memory else ""
        shm = "no /dev/shm on this system"
        need = self.shm_need(local_ranks()) / MiB
        if space := shm_space():
            shm = (
                f"{SHM_DIR} {space[0] / MiB:.1f} MiB free of {space[1] / MiB:.1f} MiB, up to {need:.1f} MiB of it "
                "for batches"
            )
        return (
            f"{head} x {self.in_flight} batches in flight ({s.num_workers} workers x prefetch_factor "
            f"{s.prefetch_factor}){pinned} = {self.mib:.1f} MiB; {shm}"
        )


def plan(batch, settings: LoaderSettings) -> Plan:
    """The plan for a real batch (as the loop received it) under these loader settings."""
    return Plan(settings, batch_bytes(batch), layout(batch))


# --- /dev/shm ---------------------------------------------------------------------------------------------------


def local_ranks() -> int:
    """Processes of this run on this host: each has its own loaders, and all of them share one /dev/shm."""
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):  # torchrun's, SLURM's ("4" or "4(x2)")
        value = os.environ.get(name, "").split("(")[0]
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def fit(settings: LoaderSettings, batch: int, max_mib=None, on_budget="adjust", ranks=1, space=None) -> tuple:
    """Settings whose batches of `batch` bytes fit, and a sentence per change: first the plan to `max_mib`
    (loader.max_prefetch_mib; None: no budget), down to 0 workers if need be (the main process loads); then what the
    `ranks` of this host may put in /dev/shm to its free bytes (`space`: (free, size); None: nothing to fit), but not
    to 0 workers, which is the user's choice to make (loader.num_workers=0): that is refused, with what to do.
    prefetch_factor is lowered first (fewer batches ahead, the same parallelism), then num_workers with one batch
    ahead each (`prefetch_factor 4 -> 2, num_workers 4 -> 3`). `on_budget="error"` refuses instead, in one line."""
    changes = []
    for limit in ("budget", "shm"):
        was = settings
        plan = Plan(settings, batch)
        if limit == "budget" and max_mib is not None:
            need, most = (lambda p: p.bytes), max_mib * MiB
            over = (
                f"the prefetch plan needs {plan.mib:.1f} MiB ({was.num_workers} workers x prefetch_factor "
                f"{was.prefetch_factor} x {batch / MiB:.2f} MiB per batch{', x2 pinned' if was.pin_memory else ''})"
                f", over loader.max_prefetch_mib={max_mib:g}"
            )
            todo = "lower loader.prefetch_factor, loader.num_workers or loader.batch_size, raise the budget"
        elif limit == "shm" and space is not None:
            need, most = (lambda p: p.shm_need(ranks)), space[0]
            over = (
                f"{SHM_DIR} has {space[0] / MiB:.1f} MiB free of {space[1] / MiB:.1f} MiB, and the loaders may put "
                f"{plan.shm_need(ranks) / MiB:.1f} MiB of batches there ({plan.shm_batches} batches of "
                f"{batch / MiB:.2f} MiB{f' x {ranks} processes on this host' if ranks > 1 else ''}, with a "
                f"{SHM_MARGIN:g}x margin)"
            )
            todo = (
                "give it more room (docker run --shm-size=1g, or a larger tmpfs on /dev/shm), lower "
                "loader.num_workers, loader.prefetch_factor or loader.batch_size, pick loader=memory-tight, or set "
                "loader.num_workers=0 (no shared memory)"
            )
        else:
            continue
        if need(plan) <= most:
            continue
        candidates = [replace(was, prefetch_factor=p) for p in range(was.prefetch_factor - 1, 0, -1)]
        candidates += [replace(was, num_workers=w, prefetch_factor=1) for w in range(was.num_workers - 1, 0, -1)]
        if limit == "budget":  # down to no workers if need be
            candidates.append(was.in_main())
        settings = next((c for c in candidates if need(Plan(c, batch)) <= most), None)
        if settings is None:
            raise UserError(f"loader: {over}; even one worker with one batch ahead does not fit: {todo}")
        if on_budget == "error":
            raise UserError(f"loader: {over}: {todo}, or set loader.on_budget=adjust")
        changed = ", ".join(
            f"{n} {getattr(was, n)} -> {getattr(settings, n)}"
            for n in ("prefetch_factor", "num_workers")
            if getattr(was, n) != getattr(settings, n)
        )
        where = "; the main process loads each batch" if not settings.num_workers else ""
        changes.append(f"{over}: {changed} ({need(Plan(settings, batch)) / MiB:.1f} MiB{where})")
    return settings, changes


def fit_loader(dataset, settings: LoaderSettings, loader_cfg, collate_fn=None) -> tuple[LoaderSettings, list[str]]:
    """The loader settings a run uses, fitted (`fit`) before any worker starts: to `loader.max_prefetch_mib`, then to
    the free space of /dev/shm. Returns them and a sentence per change (what train.py{% if cookiecutter.with_doctor == "yes" %} and the doctor log{% else %} logs{% endif %})."""
    space = shm_space() if settings.num_workers else None
    if loader_cfg.max_prefetch_mib is None and space is None:
        return settings, []
    one_batch = sample_batch_bytes(dataset, settings.batch_size, collate_fn or default_collate)
    return fit(settings, one_batch, loader_cfg.max_prefetch_mib, loader_cfg.on_budget, local_ranks(), space)
