"""The epoch plan of a shard stream (`shards`, `read(shard)`, optionally `sizes`: see stream.py): which reader (one
DataLoader worker of one rank, `rank * num_workers + worker`) reads which shards, from which record, and how many
batches a rank takes. All pure functions of (seed, epoch, sizes, readers, consumed counts): every worker and rank
computes the same plan, and a resume computes it again instead of saving it. Also what a plain stream's mid-epoch
checkpoint needs to go on (`plain_stream_refusal`), which the resume checks ask before the loader exists.
"""

from __future__ import annotations

import collections
import copy
import heapq
import itertools

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from .errors import UserError


def is_shard_stream(dataset) -> bool:
    """`shards` and `read`, and no index: a data set with `__getitem__` is read by index, whatever else it has."""
    indexed = hasattr(dataset, "__getitem__") and not isinstance(dataset, IterableDataset)
    return hasattr(dataset, "shards") and callable(getattr(dataset, "read", None)) and not indexed


def is_stream(dataset) -> bool:
    """A data set read in order, not by index: torch's IterableDataset, or a shard stream of any class."""
    return isinstance(dataset, IterableDataset) or is_shard_stream(dataset)


def shard_sizes(dataset) -> list[int] | None:
    """The data set's `sizes` as ints, checked against its shards; None when it has none."""
    sizes = getattr(dataset, "sizes", None)
    if sizes is None:
        return None
    sizes = [int(s) for s in sizes]
    if len(sizes) != len(dataset.shards) or min(sizes, default=0) < 0:
        raise UserError(
            f"{type(dataset).__name__}.sizes must give a record count >= 0 for each of its {len(dataset.shards)} "
            f"shards, got {len(sizes)} counts"
        )
    return sizes


def reader_shards(seed: int, epoch: int, sizes: list[int] | None, count: int, readers: int) -> list[list[int]]:
    """Each reader's shards this epoch, in the order it reads them: the `count` shards in an order drawn from (seed,
    epoch) alone, handed out whole, each to the reader holding the fewest records so far (with `sizes`; ties to the
    lowest reader), else round robin. Each shard is opened by one reader only."""
    key = int(np.random.SeedSequence([seed, epoch, 0x5348]).generate_state(1, np.uint64)[0] >> 1)
    out: list[list[int]] = [[] for _ in range(readers)]
    load = [(0, reader) for reader in range(readers)]
    for shard in np.random.default_rng(key).permutation(count).tolist():
        records, reader = load[0]  # without sizes one record each: the fewest so far is round robin
        out[reader].append(shard)
        heapq.heapreplace(load, (records + (1 if sizes is None else sizes[shard]), reader))
    return out


def batch_counts(plan: list[list[int]], sizes: list[int], consumed, batch_size: int) -> list[tuple[int, int]]:
    """(batches, records) each reader has left: its unconsumed records, in batches of `batch_size`, the last short."""
    left = [sum(max(sizes[s] - int(consumed[s]), 0) for s in shards) for shards in plan]
    return [(-(-n // batch_size), n) for n in left]


def round_robin(batches: list[int], first: int) -> list[int]:
    """The readers of one rank's batches in the order the DataLoader hands them out: round robin over its workers
    from `first` on, a worker whose stream ended left out (torch/utils/data/dataloader.py, iterable data sets)."""
    left, order = list(batches), []
    reader = first
    while any(left):
        if left[reader]:
            order.append(reader)
            left[reader] -= 1
        reader = (reader + 1) % len(left)
    return order


def steps_left(plan: list[list[int]], sizes: list[int], consumed, batch_size: int, workers: int) -> int:
    """Batches every rank takes from here to the epoch's end (its readers are `plan[rank * workers:][:workers]`):
    the fewest any rank can fill, so that ranks stay in lockstep."""
    counts = batch_counts(plan, sizes, consumed, batch_size)
    return min(sum(b for b, _ in counts[r : r + workers]) for r in range(0, len(plan), workers))


def dropped(plan: list[list[int]], sizes: list[int], batch_size: int, workers: int) -> int:
    """Records a whole epoch leaves out, over all ranks: those of each rank's batches past the lockstep steps."""
    consumed = [0] * len(sizes)
    steps, out = steps_left(plan, sizes, consumed, batch_size, workers), 0
    counts = batch_counts(plan, sizes, consumed, batch_size)
    for r in range(0, len(plan), workers):
        mine = counts[r : r + workers]
        kept = collections.Counter(round_robin([b for b, _ in mine], 0)[:steps])  # batches per reader
        out += sum(n - min(kept[reader] * batch_size, n) for reader, (_, n) in enumerate(mine))
    return out


def this_worker() -> tuple[int, int]:
    """(this DataLoader worker's id, the number of workers); (0, 1) in the main process."""
    info = get_worker_info()
    return (info.id, info.num_workers) if info is not None else (0, 1)


def records(dataset, rank: int = 0, world_size: int = 1):
    """A stream's records in order, this worker's share of this rank's: a shard stream's from its shards
    `reader::readers` (reader `rank * workers + worker` of `world_size * workers`), any other stream's from its own
    iterator (it splits itself)."""
    if not is_shard_stream(dataset):
        return iter(dataset)
    worker, workers = this_worker()
    shards = list(dataset.shards)[rank * workers + worker :: world_size * workers]
    return (record for shard in shards for record in dataset.read(shard))


def first_records(dataset, count: int) -> list:
    """The stream's first `count` records, read in this process from a shallow copy (a data set that opens files on
    first use does so on the copy): a shard stream's from its first shards, any other stream's from its iterator."""
    return list(itertools.islice(records(copy.copy(dataset)), count))


# How a command sets data.stream_resume whether or not the data config names it (`+` fails where it does)
RESTART_EPOCH = "++data.stream_resume=restart_epoch"


def plain_stream_refusal(state: dict, readers: int, stateful: bool, stream_resume: str) -> str | None:
    """Why a plain stream's mid-epoch loader `state` cannot continue with `readers` readers (processes x workers),
    or None. `stateful`: the stream has state_dict() and load_state_dict()."""
    if not stateful and stream_resume != "restart_epoch":
        return (
            f"is a stream without state_dict() and load_state_dict(), so where epoch {state['epoch']} stood cannot be "
            f"restored: give it both, or add {RESTART_EPOCH} to the command to start the epoch over"
        )
    if stateful and state["readers"] != readers:
        return (
            f"saved its state for {state['readers']} readers (processes x workers) and this run has {readers}: a plain "
            f"stream's state belongs to its reader; resume with loader.num_workers={state['num_workers']}"
        )
    return None
