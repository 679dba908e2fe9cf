"""The prefetch memory plan: how many bytes of batches the train loader holds in flight, and a budget for it.

Each worker keeps up to `prefetch_factor` batches ahead of the loop (torch/utils/data/dataloader.py
keeps that many indices outstanding per worker), so `num_workers x prefetch_factor` batches are in
flight. A batch lives in a shared-memory file from the moment its worker collates it until the loop
lets go of it. With pinning, the pin-memory thread copies each arrived batch into page-locked memory
and PyTorch's caching host allocator keeps those blocks for reuse: one pinned copy per batch in flight.

    prefetch bytes = bytes of one batch x num_workers x prefetch_factor x (2 when pinned, else 1)

Not in the plan: each worker's copy of the dataset object, decode buffers, collate temporaries and
the batch the loop is training on. With num_workers=0 nothing is in flight: the main process loads
each batch when the loop asks for it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch.utils.data import default_collate

from . import rng
from .errors import UserError
from .loader import LoaderSettings

MiB = 2**20


def batch_bytes(batch) -> int:
    """Bytes of every tensor (and numpy array) in a batch, however nested in tuples, lists and dicts."""
    if isinstance(batch, torch.Tensor):
        return batch.nelement() * batch.element_size()
    if isinstance(batch, np.ndarray):
        return batch.nbytes
    if isinstance(batch, Mapping):
        return sum(batch_bytes(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(batch_bytes(v) for v in batch)
    return 0  # strings, ints and other Python objects: small next to the tensors, and not in shared memory


def layout(batch) -> str:
    """`64x3x32x32 float32, 64 int64`: the tensors of a batch, for the log line."""
    if isinstance(batch, torch.Tensor):
        return "x".join(map(str, batch.shape)) + " " + str(batch.dtype).removeprefix("torch.")
    if isinstance(batch, Mapping):
        return ", ".join(f"{k}: {layout(v)}" for k, v in batch.items() if batch_bytes(v))
    if isinstance(batch, (list, tuple)):
        return ", ".join(layout(v) for v in batch if batch_bytes(v))
    return ""


def sample_batch_bytes(dataset, batch_size: int, collate_fn=default_collate) -> int:
    """Bytes of one batch, before any worker exists: sample 0 collated once, times `batch_size`.

    Exact for fixed-size samples (images after a fixed crop, labels); for variable-size ones it is
    the size of a batch of sample 0. The sample is fetched in the main process, so whatever random
    augmentation it draws is undone: the main RNG is captured before and put back after, and the
    run stays the same with or without a budget. It is fetched from a shallow copy, so a dataset that
    opens its files lazily on first use does so on the copy, and the workers do not inherit open handles.
    """
    saved = rng.capture()
    try:
        one = collate_fn([copy.copy(dataset)[0]])
    finally:
        rng.apply(saved)
    return batch_bytes(one) * batch_size


@dataclass(frozen=True)
class Plan:
    batch_bytes: int
    num_workers: int
    prefetch_factor: int | None
    pinned: bool
    layout: str = ""

    @property
    def in_flight(self) -> int:
        """Batches made ahead of the loop: num_workers x prefetch_factor (0 when the main process loads)."""
        return self.num_workers * (self.prefetch_factor or 0)

    @property
    def pinned_copies(self) -> int:
        return self.in_flight if self.pinned else 0

    @property
    def bytes(self) -> int:
        return self.batch_bytes * (self.in_flight + self.pinned_copies)

    @property
    def mib(self) -> float:
        return self.bytes / MiB

    def line(self) -> str:
        what = f" ({self.layout})" if self.layout else ""
        head = f"prefetch plan: one batch {self.batch_bytes / MiB:.2f} MiB{what}"
        if not self.num_workers:
            return f"{head}; num_workers=0 loads in the main process: 0 batches in flight = 0.0 MiB"
        pinned = f" + {self.pinned_copies} pinned copies" if self.pinned else ""
        return (
            f"{head} x {self.in_flight} batches in flight ({self.num_workers} workers x prefetch_factor "
            f"{self.prefetch_factor}){pinned} = {self.mib:.1f} MiB"
        )


def plan(batch, settings: LoaderSettings) -> Plan:
    """The plan for a real batch (as the loop received it) under these loader settings."""
    return Plan(batch_bytes(batch), settings.num_workers, settings.prefetch_factor, settings.pin_memory, layout(batch))


def plan_for(settings: LoaderSettings, one_batch_bytes: int) -> Plan:
    return Plan(one_batch_bytes, settings.num_workers, settings.prefetch_factor, settings.pin_memory)


def fit_budget(
    settings: LoaderSettings, one_batch_bytes: int, max_mib: float | None, on_budget: str = "adjust"
) -> tuple[LoaderSettings, str | None]:
    """Settings whose prefetch plan fits `max_mib`, and a sentence saying what changed (None: nothing did).

    prefetch_factor goes down first (fewer batches ahead, same parallelism); only when one batch per
    worker is still too much does num_workers go down, to 0 if need be (the main process loads; nothing
    is in flight). `on_budget="error"` refuses instead, in one line naming what to change.
    """
    if max_mib is None:
        return settings, None
    if max_mib <= 0:
        raise UserError(
            f"loader.max_prefetch_mib must be a positive number of MiB (or null for no budget), got {max_mib}"
        )
    before = plan_for(settings, one_batch_bytes)
    if before.mib <= max_mib:
        return settings, None
    if on_budget == "error":
        raise UserError(
            f"loader: the prefetch plan needs {before.mib:.1f} MiB ({before.num_workers} workers x prefetch_factor "
            f"{before.prefetch_factor} x {one_batch_bytes / MiB:.2f} MiB per batch"
            f"{', x2 pinned' if before.pinned else ''}), "
            f"over loader.max_prefetch_mib={max_mib:g}: lower loader.prefetch_factor, loader.num_workers or "
            "loader.batch_size, raise the budget, or set loader.on_budget=adjust"
        )
    per_batch = one_batch_bytes * (2 if settings.pin_memory else 1) / MiB
    fits = int(max_mib // per_batch)  # batches in flight the budget holds
    workers = settings.num_workers
    if fits >= workers:
        after = replace(settings, prefetch_factor=fits // workers)
    elif fits >= 1:
        after = replace(settings, num_workers=fits, prefetch_factor=1)
    else:
        after = replace(settings, num_workers=0, prefetch_factor=None, persistent_workers=False, timeout=0.0)
    changes = [
        f"{name} {getattr(settings, name)} -> {getattr(after, name)}"
        for name in ("prefetch_factor", "num_workers")
        if getattr(settings, name) != getattr(after, name)
    ]
    where = "; the main process loads each batch" if not after.num_workers else ""
    sentence = (
        f"the prefetch plan ({before.mib:.1f} MiB) is over loader.max_prefetch_mib={max_mib:g}: "
        f"{', '.join(changes)} ({plan_for(after, one_batch_bytes).mib:.1f} MiB in flight{where})"
    )
    return after, sentence
