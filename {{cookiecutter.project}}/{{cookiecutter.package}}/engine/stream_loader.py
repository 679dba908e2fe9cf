"""The train loader for streams (IterableDatasets): one DataLoader for the run, each record once per epoch, and a
checkpoint at any step.

Why it can be resumed (facts from torch/utils/data/dataloader.py, iterable data sets):
- Each worker iterates its own copy of the data set. The DataLoader asks the workers round robin, from worker 0
  each time it starts iterating. So the order of the batches is fixed by what each worker yields and by which
  worker goes first.
- A worker whose stream ends would be left out, and a worker that is not persistent would exit there, mid-epoch
  (`_mark_worker_as_unavailable`). So a reader that has read all its records answers each further request with an
  `ended` marker (no batch) instead: the loop skips those, and the epoch ends when every worker has sent one (or at its
  planned steps). The order of the real batches stays the round robin over the readers with records left.
- Workers make whole batches (`ReaderStream`), each with what it holds: per shard, the record its reader reads
  next (`ends`), or a plain stream's state after it. The main process keeps what the loop has *consumed*;
  batches still prefetched are ahead of the loop and do not count.
- Persistent workers keep their copy of the data set, so what a new epoch needs (its number, the worker that goes
  first, the records consumed) reaches them through a tensor in shared memory (`control`), written before `iter()`.
- A shard stream's epoch plan (engine/shard_plan.py) is a pure function of (seed, epoch, readers): resumed with
  the same readers, every reader goes on from its consumed records and the worker whose turn came next goes first,
  so the run continues batch for batch. With other readers, the shards' unconsumed records are planned again.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import logging

import torch
from torch.utils.data import IterableDataset, default_collate, get_worker_info

from . import failures, rng, shard_plan
from .errors import UserError, first_line
from .loader import BatchNote, CollateWithSnapshot, EpochLoader, GuardedDataLoader, LoaderSettings, SeedWorker

log = logging.getLogger(__name__)

PLAIN_KEY = 1 << 62  # per-record seed keys of plain streams: apart from any shard's (shard << 32 | index)


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
        try:  # `read(shard, start=...)` starts at a record: needed to read past a bad one
            self.seeks = self.shards and "start" in inspect.signature(dataset.read).parameters
        except (TypeError, ValueError):
            self.seeks = False
        methods = ("state_dict", "load_state_dict")  # Stateful
        self.stateful = not self.shards and all(callable(getattr(dataset, m, None)) for m in methods)
        # what an epoch's iter() starts from: its number, the worker that goes first, per shard the records consumed
        self.control = torch.zeros(2 + (len(dataset.shards) if self.shards else 0), dtype=torch.int64).share_memory_()
        self.resume: tuple[int, dict] = (-1, {})  # plain streams: (epoch, reader -> its state) to go on from

    def __iter__(self):
        worker, workers = shard_plan.this_worker()
        epoch, first, *consumed = self.control.tolist()
        local = (worker + first) % workers  # the reader this worker is this epoch
        records = self._records(epoch, self.rank * workers + local, self.world_size * workers, consumed)
        try:
            while (made := self._batch(records, local)) is not None:
                yield made
        except (UserError, failures.BadSample) as e:  # sent as data, raised by the main process as it takes it
            yield None, BatchNote(worker=local, failed=e)
            return
        ended = (None, BatchNote(worker=local))  # no batch: the reader has read its records
        while True:  # until the epoch ends: the worker stays in the round robin, and alive (module docstring)
            yield ended

    def _batch(self, records, local: int):
        """The reader's next batch and its BatchNote (`self.collate`'s, with where the reader stands after it), None
        at the end of its records."""
        samples, skipped, ends, state = [], [], {}, None
        with rng.kept(get_worker_info() is None, cuda=False):  # num_workers=0: the main process's RNG stays the loop's
            for bad, shard, index, item in records:
                (skipped if bad else samples).append(item)
                if len(skipped) >= self.batch_size and not samples:
                    raise failures.BadSample(
                        f"{self.batch_size} records in a row failed, e.g. {item}: check the data set's transform"
                    )
                ends[shard] = index + 1  # a plain stream's under None: its records read
                if len(samples) == self.batch_size:
                    break
            if not samples:
                return None
            count = ends.pop(None, 0)
            if self.stateful:  # its state after the batch's last record, taken once per batch, copied as it changes
                state = {"count": count, "state": copy.deepcopy(self.dataset.state_dict())}
            batch, note = self.collate(failures.Samples(samples, skipped))
        note.worker, note.ends, note.state = local, ends, state
        return batch, note

    def _records(self, epoch: int, reader: int, readers: int, consumed: list[int]):
        """(bad, shard, index, item) of each record this reader reads this epoch: the sample, or a bad record's
        error line."""
        if self.shards:
            for shard in shard_plan.reader_shards(self.seed, epoch, self.sizes, len(consumed), readers)[reader]:
                yield from self._read(epoch, shard, consumed[shard])
            return
        getattr(self.dataset, "set_epoch", lambda _: None)(epoch)  # when it has one
        saved = self.resume[1].get(reader) if epoch == self.resume[0] else None
        if saved is not None:
            self.dataset.load_state_dict(saved["state"])
        yield from self._read(epoch, None, saved["count"] if saved else 0, reader)

    def _open(self, shard: int, start: int):
        descriptor = self.dataset.shards[shard]
        records = iter(self.dataset.read(descriptor, start=start) if self.seeks else self.dataset.read(descriptor))
        if not self.seeks:  # past the consumed ones, before any record is seeded
            next(itertools.islice(records, start, start), None)
        return records

    def _read(self, epoch: int, shard: int | None, start: int, reader: int = 0):
        """A shard's records from `start` on, or (shard None) the plain stream's as reader `reader`, each seeded
        from its key, the same for any readers: a record that raised stops the run, or is skipped (skip)."""
        plain = shard is None
        key = PLAIN_KEY | (reader << 40) if plain else shard << 32
        name = f"stream reader {reader}" if plain else f"shard {shard} ({str(self.dataset.shards[shard])[:200]})"
        size = None if self.sizes is None else self.sizes[shard]  # a plain stream has none
        index, records, held = start, iter(self.dataset) if plain else self._open(shard, start), None
        base = rng.epoch_base(self.seed, epoch)  # what each record's key is mixed with
        pipelines = rng.own_generators(self.dataset)  # an augmentation library's generators, seeded per record too
        while True:
            rng.seed_sample(rng.index_seed(base, key | index), pipelines)
            try:
                bad, item = False, next(records)
            except StopIteration:
                break
            except UserError:  # the data set's own one-line message stands as it is
                raise
            except Exception as e:
                bad, item = True, e
            if size is not None and index >= size:
                held = "more"
                break
            if bad:
                line = f"{name} record {index}: {type(item).__name__}: {first_line(item)}"[:500]
                if not self.skip:
                    raise failures.BadSample(line) from item
                item, records = line, self._open(shard, index + 1)  # a generator that raised has ended
            yield bad, shard, index, item
            index += 1
        if size is not None and (held or index) != size:  # every epoch's plan rests on `sizes`
            raise UserError(
                f"{type(self.dataset).__name__}.sizes says {name} holds {size} records, but it holds {held or index}: "
                "give sizes that match the shards"
            )


class StreamLoader(EpochLoader):
    """The train loader of a stream, built once: an EpochLoader (engine/loader.py), iterated once per epoch, its
    `state_dict()` at any step. A shard stream with `sizes` knows `batches_per_epoch`: every rank takes the same
    steps (shard_plan.steps_left), the records past them counted in `dropped_records`. Without `sizes` (one process
    only) the epoch ends where the stream does. A plain stream resumes exactly when it is Stateful (`state_dict()` /
    `load_state_dict()`), with the same readers; without a state, a mid-epoch resume is refused unless
    `stream_resume="restart_epoch"`."""

    def __init__(
        self, dataset, settings: LoaderSettings, seed: int, rng_mode: str = "per_sample", collate_fn=None,
        stream_resume: str = "exact", **common,
    ):  # fmt: skip
        name = type(dataset).__name__
        if rng_mode != "per_sample":
            raise UserError(
                f"rng_mode={rng_mode}: data.train ({name}) is a stream, whose records are seeded one by one from "
                "(seed, epoch, shard, record): use rng_mode=per_sample"
            )
        super().__init__(settings, seed, rng_mode, **common)
        collate = CollateWithSnapshot(collate_fn or default_collate, capture_rng=False)  # the records are seeded
        self.stream = ReaderStream(dataset, settings.batch_size, collate, seed, self.rank, self.world_size, self.skip)
        self.kind = "shard_stream" if self.stream.shards else "stream"
        if self.skip and not self.stream.seeks:
            raise UserError(
                f"data.on_bad_sample=skip: data.train ({name}) cannot go on past a record that failed (a generator "
                "that raised has ended): make it a shard stream whose read(shard, start=0) starts at a record "
                f"({__package__.split('.')[0]}.stream.ShardStream does), or use on_bad_sample=error"
            )
        if self.world_size > 1 and self.stream.sizes is None:
            raise UserError(
                f"data.train ({name}) is a stream {'without sizes' if self.stream.shards else 'of no shards'}: under "
                "torchrun every rank must take the same steps, planned from the records per shard; give it `shards`, "
                "`read` and `sizes`, or run one process"
            )
        self.stream_resume = stream_resume
        self.workers = max(settings.num_workers, 1)  # readers per rank
        self.readers = self.world_size * self.workers
        self.batches = 0  # consumed over the run
        self.done = torch.zeros(len(self.stream.control) - 2, dtype=torch.int64)  # per shard: records the loop consumed
        self.dropped = 0  # records the epoch leaves out, over all ranks, so that ranks take the same steps
        self.batches_per_epoch: int | None = None  # None: a stream without sizes, whose epoch ends where it does
        self.epoch_ended()  # first, at_epoch_end, states, dropped_records and the plan, as every epoch starts
        self.loader = GuardedDataLoader(
            self.stream, settings, self.start_guard, batch_size=None, collate_fn=_as_is,  # whole batches
            worker_init_fn=SeedWorker(None, 0, self.worker_init, self.stack_dir),
            generator=torch.Generator().manual_seed(seed),
        )  # fmt: skip

    def worker_due(self) -> int:
        """The worker the loop waits on next (a stall names it)."""
        return self.first

    @property
    def resumes_mid_epoch(self) -> bool:
        """A checkpoint of this moment continues where the epoch stands (a resume's command needs no
        data.stream_resume=restart_epoch): all but a stateless plain stream stopped mid-epoch."""
        return self.stream.shards or self.stream.stateful or not self.position or self.stream_resume != "exact"

    def _plan(self) -> None:
        """This epoch's steps from the shards' sizes and the records consumed."""
        sizes, batch = self.stream.sizes, self.settings.batch_size
        if sizes is None:
            return
        plan = shard_plan.reader_shards(self.seed, self.epoch, sizes, len(sizes), self.readers)
        self.batches_per_epoch = self.position + shard_plan.steps_left(plan, sizes, self.done, batch, self.workers)
        self.dropped = shard_plan.dropped(plan, sizes, batch, self.workers)
        if self.batches_per_epoch < 1 and self.position == 0:
            raise UserError(
                f"data.train holds too few records for one batch of {batch} on every reader ({self.readers}): lower "
                "loader.batch_size or loader.num_workers"
            )

    def begin(self):
        """The epoch's iterator; what its workers need first goes into shared memory."""
        self.stream.control.copy_(torch.cat([torch.tensor([self.epoch, self.first]), self.done]))
        return iter(self.loader)

    def consume(self, items):
        """The batches of `items`, a reader's `ended` markers left out; where each reader stands kept."""
        known, ended = self.batches_per_epoch is not None, set()
        upcoming = None if known and self.position >= self.batches_per_epoch else self._next(items, ended)
        while upcoming is not None:
            batch, note = upcoming
            # One batch ahead: the loop must know the epoch's last batch as it takes it (without sizes, only the
            # stream's end tells). A failure in the next one is raised before this one counts, so a checkpoint
            # then still holds it.
            more = not known or self.position + 1 < self.batches_per_epoch
            upcoming = self._next(items, ended) if more else None
            if upcoming is None and more and known and self.world_size > 1:
                fewer = self.batches_per_epoch - self.position - 1
                raise failures.BadSample(
                    f"data.on_bad_sample=skip left rank {self.rank} short of epoch {self.epoch}'s "
                    f"{self.batches_per_epoch} steps, which every process takes ({fewer} batch{'es' * (fewer > 1)} "
                    "fewer): set data.on_bad_sample=error to find the bad record, fix or remove it, then resume=latest"
                )
            self.batches += 1
            self.first = (note.worker + 1) % self.workers
            for shard, end in note.ends.items():
                self.done[shard] = end
            if note.state is not None:
                self.states[self.rank * self.workers + note.worker] = note.state
            self.at_epoch_end = upcoming is None
            yield batch, note

    def epoch_ended(self) -> None:
        """The next epoch's plan, every reader from its first record. `first`: the worker whose batch comes next
        (it goes first when the epoch is iterated again); `at_epoch_end`: the batch just consumed is the epoch's last;
        `states` (Stateful plain streams): reader -> its state as of its last consumed batch; `dropped_records`:
        `dropped` of the epoch that ended last (metrics.jsonl)."""
        self.first, self.at_epoch_end, self.states, self.dropped_records = 0, False, {}, self.dropped
        self.done.zero_()
        self._plan()

    def _next(self, items, ended: set):
        """The next batch and its note; None once every reader has sent its `ended` marker (the readers'
        iterators never stop: they send markers until the epoch ends)."""
        while len(ended) < self.workers:
            batch, note = next(items)
            if batch is not None:
                return batch, note
            ended.add(note.worker)
        return None

    def own_state(self) -> dict:
        return {
            "batches": self.batches,
            "readers": self.readers,
            "first": self.first,
            "consumed": self.done.clone(),
            "states": {str(reader): state for reader, state in self.states.items()},
            "stateful": self.stream.stateful,  # what a resume's check before the run needs to know of the data set
        }

    @staticmethod
    def combined(states: list[dict]) -> dict:
        """A checkpoint's rank states as one, for a resume on another number of processes: each shard's records
        are consumed by one rank, so the counts add up."""
        return {**states[0], "consumed": torch.stack([s["consumed"] for s in states]).amax(0)}

    def load_own(self, state: dict, strict: bool, reseed: int | None) -> None:
        """`reseed`: another number of processes wrote `state`; the order of the rest of the epoch then changes,
        nothing else: a stream seeds its records by their place in their shard."""
        if state["global_batch"] != self.global_batch:
            raise UserError(
                f"resume: the checkpoint's global batch is {state['global_batch']}, this run's {self.global_batch}: "
                "resume with the same loader.batch_size"
            )
        self.batches = state["batches"]
        same = state["readers"] == self.readers and state["world_size"] == self.world_size
        if self.stream.shards:
            self.done = state["consumed"].to(torch.int64).clone()
            if self.position and not same:
                log.warning(
                    "resume: the stream was read by %d readers (processes x workers) and is now read by %d: the rest "
                    "of epoch %d, each record once, is planned again, so the order of its batches changed",
                    state["readers"], self.readers, self.epoch,
                )  # fmt: skip
        elif self.position:
            why = shard_plan.plain_stream_refusal(state, self.readers, self.stream.stateful, self.stream_resume)
            if why:
                raise UserError(f"resume: data.train ({type(self.stream.dataset).__name__}) {why}")
            if not self.stream.stateful:
                log.warning(
                    "resume: data.stream_resume=restart_epoch: epoch %d starts over (its first %d batches come again)",
                    self.epoch, self.position,
                )  # fmt: skip
                self.position = 0
            else:
                self.states = {int(reader): saved for reader, saved in state["states"].items()}
                self.stream.resume = (self.epoch, dict(self.states))
        self.first = state["first"] if same and self.position else 0
        self._plan()
