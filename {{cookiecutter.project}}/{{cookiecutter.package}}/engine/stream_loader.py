"""The train loader for streams (IterableDatasets): one DataLoader for the run, each record once per epoch, and a
checkpoint at any step.

Why it can be resumed (facts from torch/utils/data/dataloader.py, iterable data sets):
- Each worker iterates its own copy of the data set. The DataLoader asks the workers round robin, from worker 0
  each time it starts iterating. So the order of the batches is fixed by what each worker yields and by which
  worker goes first.
- A worker whose stream ends would be left out, and a worker that is not persistent would exit there, mid-epoch
  (`_mark_worker_as_unavailable`). So a reader that has read all its records answers each further request with an
  `ended` marker instead: the loop skips those, and the epoch ends when every worker has sent one (or at its
  planned steps). The order of the real batches stays the round robin over the readers with records left.
- Workers make whole batches (`ReaderStream`), each with what it holds: per shard, the record its reader reads
  next (`ends`), or a plain stream's state after it. The main process keeps what the loop has *consumed*;
  batches still prefetched are ahead of the loop and do not count.
- Persistent workers keep their copy of the data set, so what a new epoch needs (its number, the worker that goes
  first, the records consumed) reaches them through tensors in shared memory, written before `iter()`.
- A shard stream's epoch plan (engine/shard_plan.py) is a pure function of (seed, epoch, readers): resumed with
  the same readers, every reader goes on from its consumed records and the worker whose turn came next goes first,
  so the run continues batch for batch. With other readers, the shards' unconsumed records are planned again.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import itertools
import logging
import os
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from . import failures, rng, shard_plan
from .device import map_tensors
from .errors import UserError
from .loader import EpochLoader, SeedWorker, for_the_queue
from .memory import LoaderSettings

log = logging.getLogger(__name__)

RECORD, SKIPPED = 0, 1
PLAIN_KEY = 1 << 62  # per-record seed keys of plain streams: apart from any shard's (shard << 32 | index)


def seeks(dataset) -> bool:
    """The shard stream's `read(shard, start=...)` starts at a record: needed to read past a bad one."""
    try:
        return "start" in inspect.signature(dataset.read).parameters
    except (TypeError, ValueError):
        return False


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


@dataclass
class StreamBatch:
    """What travels with a batch from its worker: which worker made it, where its reader stands after it, what
    data.on_bad_sample=skip left out, and the worker's PID."""

    worker: int
    ends: dict = field(default_factory=dict)  # shard streams: shard -> the record its reader reads next
    state: dict | None = None  # plain streams: {"count": records read, "state": the data set's state_dict()}
    skipped: list = field(default_factory=list)
    pid: int = 0
    ended: bool = False  # no batch: the reader has read every record it has this epoch


def _as_is(item):
    return item


class ReaderStream(IterableDataset):
    """Worker side: the user's stream read by one reader (a worker of a rank), in whole batches.

    Shard streams: the reader reads the shards the epoch plan gives it, each from its first unconsumed record,
    and seeds every record from (seed, epoch, shard, record index). Plain streams: the data set's own iterator
    (it splits itself over workers and ranks), `set_epoch(epoch)` first when it has one, its state restored on
    a resume; records are seeded from (seed, epoch, reader, record count)."""

    def __init__(self, dataset, batch_size: int, collate, seed: int, rank: int, world_size: int, skip: bool):
        self.dataset, self.batch_size, self.collate, self.seed = dataset, batch_size, collate, seed
        self.rank, self.world_size, self.skip = rank, world_size, skip
        self.shards = shard_plan.is_shard_stream(dataset)
        self.sizes = shard_plan.shard_sizes(dataset) if self.shards else None
        self.seeks = self.shards and seeks(dataset)
        self.control = torch.zeros(2, dtype=torch.int64).share_memory_()  # epoch, the worker that goes first
        count = len(dataset.shards) if self.shards else 0
        self.consumed = torch.zeros(count, dtype=torch.int64).share_memory_()  # per shard, at the epoch's start
        self.resume: dict = {}  # plain streams: reader -> its state as of its last consumed batch
        self.resume_epoch = -1  # the epoch those states belong to
        self._base = (-1, 0)  # (epoch, rng.epoch_base of it): what each record's seed is mixed from

    def __iter__(self):
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        epoch, first = (int(v) for v in self.control.tolist())
        local = (worker + first) % workers  # the reader this worker is this epoch
        reader = self.rank * workers + local
        if self.shards:
            records = self._shard_records(epoch, reader, self.world_size * workers, self.consumed.clone())
        else:
            records = self._plain_records(epoch, reader)
        in_main = info is None
        while True:
            saved = rng.capture() if in_main else None  # num_workers=0: the main RNG untouched by the data
            try:
                made = self._batch(records, local, in_main)
            finally:
                if in_main:
                    rng.apply(saved)
            if made is None:
                break
            yield made
        ended = (None, StreamBatch(local, pid=os.getpid(), ended=True))
        while True:  # until the epoch ends: the worker stays in the round robin, and alive (module docstring)
            yield ended

    def _batch(self, records, local: int, in_main: bool):
        samples, meta, failed, count = [], StreamBatch(local, pid=os.getpid()), 0, None
        for kind, shard, index, item in records:
            if kind == SKIPPED:
                meta.skipped.append(item)
                failed += 1
                if failed >= self.batch_size and not samples:
                    raise failures.BadSample(
                        f"{self.batch_size} records in a row failed, e.g. {item}: check the data set's transform"
                    )
            else:
                samples.append(item)
            if shard is not None:
                meta.ends[shard] = index + 1
            else:
                count = index + 1
            if len(samples) == self.batch_size:
                break
        if not samples:
            return None
        if count is not None:  # a plain stream's state after the batch's last record, taken once per batch
            meta.state = {"count": count, "state": self._state()}
        batch = self.collate(samples)
        if not in_main:
            batch = map_tensors(for_the_queue, batch)
        elif meta.state is not None:
            meta.state = copy.deepcopy(meta.state)  # the data set goes on changing its own
        return batch, meta

    def _state(self):
        state_dict = getattr(self.dataset, "state_dict", None)
        return state_dict() if callable(state_dict) else None

    def _seed(self, epoch: int, key: int) -> None:
        if self._base[0] != epoch:
            self._base = (epoch, rng.epoch_base(self.seed, epoch))
        rng.seed_sample(rng.index_seed(self._base[1], key))

    def _shard_records(self, epoch: int, reader: int, readers: int, consumed: torch.Tensor):
        plan = shard_plan.reader_shards(self.seed, epoch, self.sizes, len(self.dataset.shards), readers)[reader]
        for shard in plan:
            yield from self._read_shard(epoch, shard, int(consumed[shard]))

    def _open(self, shard: int, start: int):
        descriptor = self.dataset.shards[shard]
        if self.seeks:
            return iter(self.dataset.read(descriptor, start=start))
        records = iter(self.dataset.read(descriptor))
        for _ in itertools.islice(records, start):  # read past the consumed ones, before any record is seeded
            pass
        return records

    def _pull(self, records, epoch: int, key: int):
        """The iterator's next record, its randomness seeded from `key`: `(sample, None)`, `(None, error)` when it
        raised, or None at its end."""
        self._seed(epoch, key)
        try:
            return next(records), None
        except StopIteration:
            return None
        except UserError:  # the data set's own one-line message stands as it is
            raise
        except Exception as e:
            return None, e

    def _read_shard(self, epoch: int, shard: int, start: int):
        index, records = start, self._open(shard, start)
        while (pulled := self._pull(records, epoch, (shard << 32) | index)) is not None:  # the same for any readers
            if self.sizes is not None and index >= self.sizes[shard]:
                raise self._miscounted(shard, "more")
            sample, error = pulled
            if error is None:
                yield RECORD, shard, index, sample
            else:
                line = f"shard {shard} ({str(self.dataset.shards[shard])[:200]}) record {index}: {_first_line(error)}"
                if not self.skip:
                    raise failures.BadSample(line) from error
                yield SKIPPED, shard, index, line
                records = self._open(shard, index + 1)  # a generator that raised has ended: start after the record
            index += 1
        if self.sizes is not None and index != self.sizes[shard]:
            raise self._miscounted(shard, index)

    def _miscounted(self, shard: int, held) -> UserError:
        """The plan of every epoch rests on `sizes`: a shard that holds another number of records stops the run."""
        return UserError(
            f"{type(self.dataset).__name__}.sizes says shard {shard} ({str(self.dataset.shards[shard])[:200]}) holds "
            f"{self.sizes[shard]} records, but it holds {held}: give sizes that match the shards"
        )

    def _plain_records(self, epoch: int, reader: int):
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        count = 0
        saved = self.resume.get(reader) if epoch == self.resume_epoch else None
        if saved is not None:
            count = saved["count"]
            if saved["state"] is not None:
                self.dataset.load_state_dict(saved["state"])
        records = iter(self.dataset)
        while (pulled := self._pull(records, epoch, PLAIN_KEY | (reader << 40) | count)) is not None:
            sample, error = pulled
            if error is not None:
                raise failures.BadSample(f"stream reader {reader} record {count}: {_first_line(error)}") from error
            yield RECORD, None, count, sample
            count += 1


class StreamLoader(EpochLoader):
    """The train loader of a stream, built once. Iterate it once per epoch; `state_dict()` at any step.

    An EpochLoader (engine/loader.py), as TrainLoader is: `epoch`, `position` (batches of this epoch consumed),
    `batches_per_epoch` (known for a shard stream with `sizes`; else None, and the epoch ends where the stream
    does), `at_epoch_end`, `worker_pids`, `skipped`, `start_next_epoch()`.
    - Shard stream, `sizes`: every rank takes the same steps (shard_plan.steps_left); the records past them are
      dropped, counted in `dropped`.
    - Without `sizes`, one process only: the epoch's length is known when it ends.
    - Plain streams resume exactly when they are Stateful (`state_dict()` / `load_state_dict()`), with the same
      readers; without a state, a mid-epoch resume is refused unless `stream_resume="restart_epoch"`.
    """

    def __init__(
        self,
        dataset,
        settings: LoaderSettings,
        seed: int,
        rng_mode: str = "per_sample",
        collate_fn=None,
        rank: int = 0,
        world_size: int = 1,
        worker_init=None,
        on_bad_sample: str = "error",
        bad_samples: failures.BadSampleLog | None = None,
        start_guard=contextlib.nullcontext,
        stream_resume: str = "exact",
    ):
        name = type(dataset).__name__
        if rng_mode != "per_sample":
            raise UserError(
                f"rng_mode={rng_mode}: data.train ({name}) is a stream, whose records are seeded one by one from "
                "(seed, epoch, shard, record): use rng_mode=per_sample"
            )
        if stream_resume not in ("exact", "restart_epoch"):
            raise UserError(f"data.stream_resume must be exact or restart_epoch, got {stream_resume!r}")
        super().__init__(
            settings, seed, rng_mode, rank, world_size, worker_init, on_bad_sample, bad_samples, start_guard
        )  # fmt: skip
        self.stream = ReaderStream(
            dataset, settings.batch_size, collate_fn or torch.utils.data.default_collate, seed, rank, world_size,
            skip=self.skip,
        )  # fmt: skip
        shards = self.stream.shards
        self.kind = "shard_stream" if shards else "stream"
        if self.skip and not self.stream.seeks:
            raise UserError(
                f"data.on_bad_sample=skip: data.train ({name}) cannot go on past a record that failed (a generator "
                "that raised has ended): make it a shard stream whose read(shard, start=0) starts at a record "
                f"({__package__.split('.')[0]}.stream.ShardStream does), or use on_bad_sample=error"
            )
        if world_size > 1 and self.stream.sizes is None:
            raise UserError(
                f"data.train ({name}) is a stream {'without sizes' if shards else 'of no shards'}: under torchrun "
                "every rank must take the same steps, planned from the records per shard; give it `shards`, `read` and "
                "`sizes`, or run one process"
            )
        self.stream_resume = stream_resume
        self.workers = max(settings.num_workers, 1)  # readers per rank
        methods = ("state_dict", "load_state_dict")
        self.stateful = not shards and all(callable(getattr(dataset, m, None)) for m in methods)
        self.batches = 0  # consumed over the run
        self.first = 0  # the worker whose batch comes next: goes first when the epoch is iterated again
        self.done = np.zeros(len(self.stream.consumed), dtype=np.int64)  # per shard: records the loop consumed
        self.states: dict[int, dict] = {}  # plain streams: reader -> its state as of its last consumed batch
        self.dropped = 0  # records the epoch leaves out, over all ranks, so that ranks take the same steps
        self.dropped_records = 0  # the same, of the epoch that ended last (metrics.jsonl)
        self.batches_per_epoch: int | None = None
        self._last = False  # the batch just consumed is the epoch's last
        self._plan()

    @property
    def readers(self) -> int:
        return self.world_size * self.workers

    @property
    def at_epoch_end(self) -> bool:
        return self._last

    def worker_due(self) -> int:
        """The worker the loop waits on next (a stall names it)."""
        return self.first

    @property
    def resumes_mid_epoch(self) -> bool:
        """A checkpoint of this moment continues where the epoch stands (a resume's command needs no
        data.stream_resume=restart_epoch)."""
        stateless = not self.stream.shards and not self.stateful
        return not (stateless and self.position and self.stream_resume == "exact")

    def __len__(self) -> int:
        if self.batches_per_epoch is None:
            raise TypeError("a stream without sizes has no length before its epoch ends")
        return self.batches_per_epoch - self.position

    def _plan(self) -> None:
        """This epoch's steps from the shards' sizes and the records consumed."""
        sizes = self.stream.sizes
        if sizes is None:
            self.batches_per_epoch = None
            return
        plan = shard_plan.reader_shards(self.seed, self.epoch, sizes, len(sizes), self.readers)
        b = self.settings.batch_size
        self.batches_per_epoch = self.position + shard_plan.steps_left(plan, sizes, self.done, b, self.workers)
        self.dropped = shard_plan.dropped(plan, sizes, b, self.workers)
        if self.batches_per_epoch < 1 and self.position == 0:
            raise UserError(
                f"data.train holds too few records for one batch of {self.settings.batch_size} on every reader "
                f"({self.readers}): lower loader.batch_size or loader.num_workers"
            )

    def begin_early(self):
        """The epoch's iterator; what its workers need first goes into shared memory."""
        self.stream.control.copy_(torch.tensor([self.epoch, self.first]))
        self.stream.consumed.copy_(torch.from_numpy(self.done))
        if self.loader is None:
            self.loader = self.guarded(
                self.stream, batch_size=None, collate_fn=_as_is,  # the workers make whole batches
                worker_init_fn=SeedWorker(None, 0, self.worker_init, self.stack_dir),
                generator=torch.Generator().manual_seed(self.seed),
            )  # fmt: skip
        return iter(self.loader)

    def __iter__(self):
        self.worker_pids = set()
        if self.position == 0:
            self.skipped = 0
        iterator = self._early if self._early is not None else self.begin_early()
        self._early = None
        known, ended = self.batches_per_epoch is not None, set()
        upcoming = None if known and self.position >= self.batches_per_epoch else self._next(iterator, ended)
        while upcoming is not None:
            batch, meta = upcoming
            # One batch ahead: the loop must know the epoch's last batch as it takes it (without sizes, only the
            # stream's end tells). A failure in the next one is raised before this one counts, so a checkpoint
            # then still holds it.
            more = not known or self.position + 1 < self.batches_per_epoch
            upcoming = self._next(iterator, ended) if more else None
            if upcoming is None and known and self.position + 1 < self.batches_per_epoch and self.world_size > 1:
                fewer = self.batches_per_epoch - self.position - 1
                raise failures.BadSample(
                    f"data.on_bad_sample=skip left rank {self.rank} short of epoch {self.epoch}'s "
                    f"{self.batches_per_epoch} steps, which every process takes ({fewer} batch{'es' * (fewer > 1)} "
                    "fewer): set data.on_bad_sample=error to find the bad record, fix or remove it, then resume=latest"
                )
            self._consume(meta)
            self._last = upcoming is None
            yield batch
        self.epoch, self.position, self.first, self._last = self.epoch + 1, 0, 0, False
        self.dropped_records = self.dropped
        self.done[:] = 0
        self.states = {}
        self._plan()

    def _next(self, iterator, ended: set):
        """The next batch and what it carries; None once every reader has sent its `ended` marker."""
        while len(ended) < self.workers:
            try:
                batch, meta = self.next_batch(iterator)
            except StopIteration:
                return None
            if not meta.ended:
                return batch, meta
            ended.add(meta.worker)
        return None

    def _consume(self, meta: StreamBatch) -> None:
        self.position += 1
        self.batches += 1
        self.first = (meta.worker + 1) % self.workers
        for shard, end in meta.ends.items():
            self.done[shard] = end
        if meta.state is not None:
            self.states[self.rank * self.workers + meta.worker] = meta.state
        self.worker_pids.add(meta.pid)
        self.count_skipped(meta.skipped)

    def batches_done(self) -> int:
        return self.batches

    def own_state(self) -> dict:
        return {
            "batches": self.batches,
            "readers": self.readers,
            "first": self.first,
            "consumed": torch.from_numpy(self.done.copy()),
            "states": {str(reader): state for reader, state in self.states.items()},
            "stateful": self.stateful,  # what a resume's check before the run needs to know of the data set
        }

    @staticmethod
    def combined(states: list[dict]) -> dict:
        """A checkpoint's rank states as one, for a resume on another number of processes: each shard's records
        are consumed by one rank, so the counts add up."""
        merged = dict(states[0])
        merged["consumed"] = torch.stack([s["consumed"] for s in states]).amax(0)
        return merged

    def load_own(self, state: dict, strict: bool, reseed: int | None) -> None:
        """`reseed`: another number of processes wrote `state`; the order of the rest of the epoch then changes,
        nothing else: a stream seeds its records by their place in their shard."""
        if state["global_batch"] != self.global_batch:
            raise UserError(
                f"resume: the checkpoint's global batch is {state['global_batch']}, this run's {self.global_batch}: "
                "resume with the same loader.batch_size"
            )
        self.epoch, self.position, self.batches = state["epoch"], state["position"], state["batches"]
        self.skipped = state["skipped"] if self.position else 0
        same = state["readers"] == self.readers and state["world_size"] == self.world_size
        if self.stream.shards:
            self.done = state["consumed"].numpy().astype(np.int64).copy()
            self.first = state["first"] if same else 0
            if self.position and not same:
                log.warning(
                    "resume: the stream was read by %d readers (processes x workers) and is now read by %d: the rest "
                    "of epoch %d, each record once, is planned again, so the order of its batches changed",
                    state["readers"], self.readers, self.epoch,
                )  # fmt: skip
        elif self.position:
            why = plain_stream_refusal(state, self.readers, self.stateful, self.stream_resume)
            if why:
                raise UserError(f"resume: data.train ({type(self.stream.dataset).__name__}) {why}")
            if not self.stateful:
                log.warning(
                    "resume: data.stream_resume=restart_epoch: epoch %d starts over (its first %d batches come again)",
                    self.epoch, self.position,
                )  # fmt: skip
                self.position = 0
            else:
                self.first = state["first"]
                self.states = {int(reader): saved for reader, saved in state["states"].items()}
                self.stream.resume, self.stream.resume_epoch = dict(self.states), self.epoch
        self._plan()


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


# How a command sets data.stream_resume whether or not the data config names it (`+` fails where it does)
RESTART_EPOCH = "++data.stream_resume=restart_epoch"
