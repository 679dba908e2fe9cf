"""The train loader of an indexed data set and the validation loader: built once, reused every epoch, and the train
loader resumable bit for bit.

Why it resumes exactly is docs/resume.md's "What is saved" (facts from torch/utils/data/dataloader.py): the batch
order is a pure function of (seed, epoch) (`EpochBatchSampler`); under rng_mode=per_worker, batch `i` of an epoch
is made by worker `i % W` (round robin from worker 0 each epoch), and each batch brings back a snapshot of that
worker's RNG, its *stream* `i % W`, of which the loop keeps the last one it consumed (TrainLoader).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import weakref
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import torch
{% if cookiecutter.with_streams == "yes" %}
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler, default_collate, get_worker_info

from . import failures, rng, shard_plan
{% else %}
from torch.utils.data import BatchSampler, DataLoader, Sampler, default_collate, get_worker_info

from . import failures, rng
{% endif %}
from .device import map_tensors
from .errors import UserError

log = logging.getLogger(__name__)


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class LoaderSettings:
    """A loader profile after validation: what actually reaches the DataLoader."""

    batch_size: int
    num_workers: int
    prefetch_factor: int | None
    pin_memory: bool
    persistent_workers: bool
    timeout: float

    def in_main(self) -> LoaderSettings:
        """These settings with the main process loading (num_workers=0): prefetch, persistent workers and the workers'
        timeout do not apply (DataLoader refuses the first two without workers)."""
        return replace(self, num_workers=0, prefetch_factor=None, persistent_workers=False, timeout=0.0)


# where a key set to `tune` starts before the trials (balanced's values); eval.py reads a tuned run's keys
# so too
TUNE_START = {"num_workers": 2, "prefetch_factor": 2, "pin_memory": "auto", "persistent_workers": True}


def resolve_settings(cfg, device_type: str) -> LoaderSettings:
    """Settle a loader profile's `auto` values; combinations that cannot apply are adjusted and said so. The ranges of
    its keys are the schema's (schema.py's LoaderConfig), checked as the config is composed. A key set to
    `tune` (loader=auto) starts from balanced's value here; loader_tuning picks it."""
    cfg = {**cfg, **{k: v for k, v in TUNE_START.items() if cfg[k] == "tune"}}
    workers = usable_cpus() if cfg["num_workers"] == "auto" else cfg["num_workers"]
    pin = device_type == "cuda" if cfg["pin_memory"] == "auto" else cfg["pin_memory"]
    if pin and device_type != "cuda":
        log.warning("loader: pin_memory only speeds up copies to CUDA; turned off on %s", device_type)
        pin = False
    prefetch = 2 if cfg["prefetch_factor"] is None else cfg["prefetch_factor"]  # null: PyTorch's own default
    persistent, timeout = cfg["persistent_workers"], float(cfg["timeout"])
    settings = LoaderSettings(cfg["batch_size"], workers, prefetch, pin, persistent, timeout)
    if workers:
        return settings
    # no note for timeout: the watchdog is on by default, and the main process loading has no worker to stall
    ignored = [k for k in ("persistent_workers", "prefetch_factor") if cfg[k]]
    if ignored:
        log.warning("loader: num_workers=0 loads in the main process; ignoring %s", ", ".join(ignored))
    return settings.in_main()


class EpochBatchSampler(Sampler):
    """The training batches of one epoch: a permutation fixed by (seed, epoch), this rank's share of it, from batch
    `start` on.

    It keeps no RNG of its own, so its whole state is (epoch, start); sharding by rank makes it
    stand in for DistributedSampler. A data set with `epoch_order(seed, epoch)` (a pure function
    returning a permutation, e.g. shards.py's, which keeps reads local) passes it as `order_fn`
    and it replaces the uniform permutation.

    It is defined over the *global* batch `g = batch_size * world_size`: global batch `i` of an epoch is entries
    `[i*g, (i+1)*g)` of the epoch's permutation and rank `r` takes every `world_size`-th of them from entry `r` on.
    The set of samples of a global step then does not depend on how many processes share it, which is what lets a
    run resume on another number of processes. An epoch has `size // g` steps; the `size % g` samples left over
    (other ones each epoch, the permutation changing) are dropped, as DistributedSampler's drop_last drops them,
    and no sample is padded in twice.
    """

    def __init__(self, size: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1, order_fn=None):
        self.size, self.batch_size, self.seed, self.order_fn = size, batch_size, seed, order_fn
        self.rank, self.world_size, self.global_batch = rank, world_size, batch_size * world_size
        self.batches_per_epoch = size // self.global_batch
        self.epoch, self.start = 0, 0
        if self.batches_per_epoch < 1:
            per = f"a global batch of {self.global_batch} ({batch_size} per process x {world_size} processes)"
            raise UserError(
                f"the data set has {size} samples, too few for "
                f"{per if world_size > 1 else f'one batch of {batch_size}'}: lower loader.batch_size"
            )

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def permutation(self) -> np.ndarray:
        """The epoch's order of all samples, the same on every rank."""
        if self.order_fn is None:
            seed = rng.epoch_base(self.seed, self.epoch) >> 1
            return torch.randperm(self.size, generator=torch.Generator().manual_seed(seed)).numpy()
        order = np.asarray(self.order_fn(self.seed, self.epoch))
        if order.shape != (self.size,) or not np.array_equal(np.sort(order), np.arange(self.size)):
            raise UserError(f"{self.order_fn.__qualname__} must return a permutation of the {self.size} sample numbers")
        return order

    def __len__(self) -> int:
        return self.batches_per_epoch - self.start

    def __iter__(self):
        # global batch i is order[i*g:(i+1)*g]; rank r's share of it, every world_size-th entry, is its [i*b:(i+1)*b]
        order = self.permutation()[: self.batches_per_epoch * self.global_batch][self.rank :: self.world_size]
        batches = order.reshape(-1, self.batch_size).tolist()
        return iter([BatchIndices(batches[i], self.epoch, i) for i in range(self.start, self.batches_per_epoch)])


class BatchIndices(list):
    """The sample indices of one batch, tagged with (epoch, batch number) for the worker that makes it.

    Persistent workers never see main-process changes (they hold their own copies), so what a
    worker must know about the batch travels with the indices.
    """

    def __init__(self, indices, epoch: int, number: int):
        super().__init__(indices)
        self.epoch, self.number = epoch, number


class SeededBatches(torch.utils.data.Dataset):
    """Wraps the user's dataset so a whole batch is fetched at once (`__getitems__`).

    rng_mode=per_sample: before each sample, torch, numpy and python `random` are seeded from (seed, epoch, sample
    index) (`rng.index_seed`; `rng.SampleSeeding` leaves out the ones a data set never draws from), so what a sample
    draws depends on neither the worker nor the rank nor the batch that makes it: the same for any worker count,
    loader profile or number of processes. Samples are then made one by one; a data set with `prefetch(indices)` may
    read the batch's bytes at once first (shards.py does).
    rng_mode=per_worker: the worker's own streams run on; TrainLoader saves and restores them.
    A sample that raises is named (data set index, file) or, with `skip`, left out: failures.fetch_guarded.
    """

    def __init__(self, dataset, seed: int, per_sample: bool, skip: bool = False):
        self.dataset, self.seed, self.skip = dataset, seed, skip
        self.seeding = rng.SampleSeeding(dataset) if per_sample else None

    def __getitems__(self, batch: BatchIndices):
        if self.seeding is None:
            return self._fetch(batch)
        prefetch = getattr(self.dataset, "prefetch", None)
        if prefetch is not None:
            prefetch(list(batch))
        base = rng.epoch_base(self.seed, batch.epoch)
        make = self.seeding.sample
        return self.seeding.batch(
            lambda: failures.fetch_guarded(self.dataset, batch, self.skip, lambda i: make(base, i))
        )

    def _fetch(self, batch):
        many = getattr(self.dataset, "__getitems__", None)
        if many:
            try:
                return failures.Samples(many(list(batch)))
            except UserError as e:
                return failures.Samples([], failed=e)
            except Exception:  # one sample failed, somewhere in the batch: one by one finds which
                pass
        return failures.fetch_guarded(self.dataset, batch, self.skip)


class SeededSamples(torch.utils.data.Dataset):
    """A validation data set under rng_mode=per_sample: before each sample, the generators are seeded from (seed,
    the sample's index) as a training sample's are (`rng.VALIDATION` its epoch), so a random crop or a test-time
    augmentation draws the same at every validation, for any profile, worker count or number of processes; in the
    main process (num_workers=0) its RNG is put back."""

    def __init__(self, dataset, seed: int):
        self.base, self.seeding = rng.epoch_base(seed, rng.VALIDATION), rng.SampleSeeding(dataset)

    def __len__(self) -> int:
        return len(self.seeding.dataset)

    def __getitems__(self, indices: list) -> list:
        return self.seeding.batch(lambda: [self.seeding.sample(self.base, i) for i in indices])


@dataclass
class BatchNote:
    """What travels with a batch from the process that made it, for the main process's bookkeeping."""

    pid: int | None = None  # the worker's; None: made in the main process (num_workers=0)
    samples: int = 0  # the samples collated into it: what samples/s counts, whatever form the batch has
    skipped: list = field(default_factory=list)  # the samples data.on_bad_sample=skip left out of it
    # An indexed data set's: the worker's RNG right after making it (rng_mode=per_worker only: with per_sample every
    # sample is seeded afresh, so nothing reads it), and the seed base of its set of workers.
    rng: tuple | None = None
    base_seed: int = 0
    # What made the batch fail (a bad sample, a data set's UserError), sent as data: the main process raises it in
    # one line as the loop reaches the batch (failures.named), where a raise in a worker comes as a traceback's text
    failed: Exception | None = None
{% if cookiecutter.with_streams == "yes" %}
    worker: int = 0  # a stream's: the worker that made it
    ends: dict = field(default_factory=dict)  # a shard stream's: shard -> the record its reader reads next
    state: dict | None = None  # a Stateful plain stream's: {"count": records read, "state": its state_dict()}
{% endif %}


# A CPU tensor up to this size (labels, a few scalars) travels inside the pickled batch: a shared-memory file costs
# the worker a file, a mapping and an fd handed over a socket, and the main process ~80 us per tensor to receive.
# Small, so that the batches in flight stay far below a pipe's 64 KiB: the images still go through shared memory.
INLINE_BYTES = 4 * 1024


@dataclass
class InlineTensor:
    """A small tensor pickled by value (its bytes), so the worker queue's pickler does not move it to shared
    memory; it arrives in the main process as a plain tensor again."""

    tensor: torch.Tensor

    def __reduce__(self):
        t = self.tensor.detach()
        return _from_bytes, (t.reshape(-1).view(torch.uint8).numpy().tobytes(), t.dtype, tuple(t.shape))


def _from_bytes(data: bytes, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)


def for_the_queue(t: torch.Tensor):
    """A worker's batch tensor as it goes on the queue: a small one by value (InlineTensor), a larger one moved
    to shared memory here (CollateWithSnapshot says why); one on a device as it is."""
    if t.device.type != "cpu":
        return t
    if 0 < t.nbytes <= INLINE_BYTES and t.is_contiguous() and t.layout == torch.strided and not t.is_quantized:
        return InlineTensor(t)
    return t.share_memory_()


@dataclass
class CollateWithSnapshot:
    """Runs the real collate_fn, then, in a worker, captures the worker's RNG (after any RNG the collate used).

    Returns (batch, BatchNote); `samples.skipped` (failures.Samples) are the samples data.on_bad_sample=skip left
    out. In a worker, every larger tensor of the batch is moved to shared memory here, inside the fetch: torch would
    otherwise do it for tensors the collate did not allocate there while the worker's queue sends the batch,
    in a feeder thread whose failure (a full /dev/shm) only prints and loses the batch, leaving the loop to
    wait. Here it fails as an exception the main process receives in the batch's place. Small tensors (labels)
    go by value instead (InlineTensor)."""

    collate_fn: object
    capture_rng: bool

    def __call__(self, samples):
        if samples.failed is not None:
            return None, BatchNote(failed=samples.failed)
        batch = self.collate_fn(list(samples))
        note, info = BatchNote(samples=len(samples), skipped=samples.skipped), get_worker_info()
        if info is None:  # num_workers=0: the main process RNG, saved with the main state
            return batch, note
        note.pid, note.base_seed = os.getpid(), info.seed - info.id
        note.rng = rng.capture() if self.capture_rng else None  # ~50 us with its pickling: only where it is read
        return map_tensors(for_the_queue, batch), note


class SeedWorker:
    """worker_init_fn: runs the caller's `worker_init` first (train.py's keeps stop signals away from workers), then
    a fresh worker seeds torch, numpy and python `random` from `get_worker_info().seed`; a restored one takes
    stream `(worker_id + rotation) % W` of the given streams. With `stack_dir`, the worker writes its Python
    stack there when a stall is reported (failures.arm_stack_dump)."""

    def __init__(self, streams: list | None, rotation: int, worker_init, stack_dir: str | None):
        self.streams = None if streams is None else list(streams)  # as they stand now: the loader's list runs on
        self.rotation, self.worker_init, self.stack_dir = rotation, worker_init, stack_dir

    def __call__(self, worker_id: int) -> None:
        if self.worker_init is not None:
            self.worker_init(worker_id)
        failures.arm_stack_dump(self.stack_dir, worker_id)
        if self.streams is None:
            rng.seed_cpu(get_worker_info().seed)  # the state rng.from_seed(seed) describes, as the main process assumes
        else:
            rng.apply(self.streams[(worker_id + self.rotation) % len(self.streams)])


class GuardedDataLoader(DataLoader):
    """A DataLoader with the workers, prefetch, pinning, timeout and persistence of `settings` (`kwargs` may
    override them), whose workers start inside `start_guard()`, a context manager factory: train.py passes
    `StopRequest.starting_workers`, which keeps a SIGTERM away from a worker until its worker_init_fn shields it.
    Workers start in `iter()`: every epoch's, or the first one's only when they are persistent."""

    def __init__(self, dataset, settings: LoaderSettings, start_guard=contextlib.nullcontext, **kwargs):
        # the batches are the caller's (batch_sampler, or batch_size in kwargs): 1 is DataLoader's own default
        super().__init__(dataset, **{**asdict(settings), "batch_size": 1, **kwargs})
        self.start_guard = start_guard

    def __iter__(self):
        with self.start_guard():
            return super().__iter__()


class EpochLoader:
    """What the train loaders share: one DataLoader for the run (`loader`), iterated once per epoch; `epoch` (epochs
    done), `position` (batches of this epoch consumed), the workers that served it, what `data.on_bad_sample=skip`
    left out (listed in `bad_samples`), the next epoch started early, and a state for checkpoints.
    Each train loader (TrainLoader{% if cookiecutter.with_streams == "yes" %}, StreamLoader{% endif %}) adds how an epoch's batches are planned, seeded and
    resumed: `begin()` (the epoch's iterator from `position` on), `consume(items)` (its
    (batch, BatchNote) pairs, tracked), `own_state()` and `load_own()`."""

    kind = "indexed"  # a checkpoint's loader state says which loader wrote it
{% if cookiecutter.with_streams == "yes" %}
    resumes_mid_epoch = True  # a checkpoint at any step continues where the epoch stands
{% endif %}

    def __init__(
        self, settings: LoaderSettings, seed: int, rng_mode: str = "per_sample", rank: int = 0, world_size: int = 1,
        worker_init=None, on_bad_sample: str = "error", bad_samples: failures.BadSampleLog | None = None,
        start_guard=contextlib.nullcontext,
    ):  # fmt: skip
        self.settings, self.seed, self.rng_mode, self.rank, self.world_size = settings, seed, rng_mode, rank, world_size
        self.worker_init, self.start_guard, self.bad_samples = worker_init, start_guard, bad_samples
        self.skip = on_bad_sample == "skip"
        self.stack_dir = None  # where workers write their stacks when a stall is reported (failures.stalled)
        if settings.num_workers and settings.timeout:
            self.stack_dir = tempfile.mkdtemp(prefix="worker-stacks-")
            weakref.finalize(self, shutil.rmtree, self.stack_dir, True)
        self.loader: DataLoader | None = None  # the DataLoader reused every epoch (one-off ones are not kept)
        self.epoch = 0  # epochs completed
        self.position = 0  # batches of the current epoch consumed by the loop
        self.drawn = 0  # the samples in the batch the loop took last (BatchNote.samples)
        self.worker_pids: set[int] = set()  # workers that served this epoch
        self.skipped = 0  # samples left out of this epoch's consumed batches (data.on_bad_sample=skip)
        self._early = None  # the next epoch's iterator, made early (start_next_epoch)
        self.pick: dict | None = None  # loader=auto's pick (Pick.saved()), which a resume reuses

    @staticmethod
    def combined(states: list[dict]) -> dict:
        """A checkpoint's rank states as one, for a resume on another number of processes: the position is global
        (the same on every rank), and no rank's generator or worker streams carry over (load_state_dict's reseed)."""
        return states[0]

    @property
    def global_batch(self) -> int:
        return self.settings.batch_size * self.world_size

    def __len__(self) -> int:
        return self.batches_per_epoch - self.position  # a stream without sizes (None) has none: a TypeError

    def __iter__(self):
        """The rest of this epoch's batches; once they are all consumed, the epoch counts as done."""
        self.worker_pids = set()
        if self.position == 0:
            self.skipped = 0
        iterator = self._early if self._early is not None else self.begin()
        self._early = None
        for batch, note in self.consume(failures.named(iterator, self)):
            self.position, self.drawn = self.position + 1, note.samples
            if note.pid is not None:
                self.worker_pids.add(note.pid)
            if note.skipped:  # listed in bad_samples.txt
                self.skipped += len(note.skipped)
                if self.bad_samples is not None:
                    self.bad_samples.add(self.epoch, note.skipped)
            yield batch
        self.epoch, self.position = self.epoch + 1, 0
{% if cookiecutter.with_streams == "yes" %}
        self.epoch_ended()

    def epoch_ended(self) -> None:
        """What a loader does once an epoch is done, beyond counting it."""
{% endif %}

    def start_next_epoch(self) -> None:
        """Hand the persistent workers the next epoch's first batches now, e.g. while validation runs.

        Only with persistent workers: they are alive during validation anyway, and what they queue is within the
        prefetch plan (non-persistent profiles keep their promise to free memory between epochs). Nothing is
        consumed, so the position and the state stay as they are. (Persistent workers are never zero: the
        DataLoader refuses persistent_workers without workers, and resolve_settings turns it off there.)"""
        if self._early is None and not self.position and self.settings.persistent_workers:
            self._early = self.begin()

    def progress(self) -> dict:
        """The run's progress, the same whatever the number of processes: a resume on another number continues it."""
        return {
            "epoch": self.epoch,
            "position": self.position,  # global batches of this epoch consumed
            "batches": self.batches,  # global batches consumed over the run
            "samples": self.batches * self.global_batch,{% if cookiecutter.with_streams == "yes" %}  # a stream's: at most (a reader's last batch may be short){% endif +%}
            "global_batch": self.global_batch,
            "world_size": self.world_size,
        }

    def state_dict(self) -> dict:
        """What every loader's checkpoint state holds, and its own (`own_state`)."""
        return {
            "kind": self.kind,
            "epoch": self.epoch,
            "position": self.position,
            "batch_size": self.settings.batch_size,
            "global_batch": self.global_batch,
            "num_workers": self.settings.num_workers,
            "world_size": self.world_size,
            "rng_mode": self.rng_mode,
            "skipped": self.skipped,
            "pick": self.pick,
            **self.own_state(),
        }

    def load_state_dict(self, state: dict, strict: bool = True, reseed: int | None = None) -> None:
        """Continue from `state`, a rank's `state_dict()` (`reseed`: another number of processes wrote it)."""
{% if cookiecutter.with_streams == "yes" %}
        kind = state["kind"]
        if kind != self.kind:
            said = {"indexed": "an indexed data set", "stream": "a stream", "shard_stream": "a shard stream"}
            raise UserError(
                f"resume: the checkpoint's train data was {said[kind]} and this run's is {said[self.kind]}: resume "
                "with the data the run started with"
            )
{% endif %}
        self.epoch, self.position = state["epoch"], state["position"]
        self.skipped = state["skipped"] if self.position else 0
        self.load_own(state, strict, reseed)


class TrainLoader(EpochLoader):
    """The train loader of an indexed data set (the module docstring says why it resumes exactly): one DataLoader for
    the whole run, iterated once per epoch; `state_dict()` at any step.

    State: `epoch`, `position` (global batches of this epoch consumed, the same on every rank and for any number of
    processes), `generator` (draws worker base seeds) and, rng_mode=per_worker, `streams` (None: fresh workers that
    have served nothing yet). When an epoch begins:
    - at batch 0, the workers go on only when they are persistent and served the whole last epoch (`reuse`: each
      one's RNG is then its stream); otherwise new ones start, fresh when not persistent (a new base seed every
      epoch, as PyTorch does), else from `streams` (after a resume, or after one-off workers);
    - mid-way (after a resume), one-off workers start from `streams`, worker `w` carrying stream
      `(w + rotation) % W`, `rotation = position % W`, with a throwaway generator so `generator` stays in step;
    - early (`start_next_epoch`): `before`, the generator before the iterator drew a base seed, is what
      `state_dict()` saves until the loop takes it.
    With num_workers=0 there are no workers: the main process RNG is saved with the main state.
    """

    def __init__(self, dataset, settings: LoaderSettings, seed: int, rng_mode: str = "per_sample", collate_fn=None,
                 **common):  # fmt: skip
        super().__init__(settings, seed, rng_mode, **common)
        self.dataset = SeededBatches(dataset, seed, per_sample=rng_mode == "per_sample", skip=self.skip)
        order_fn = getattr(dataset, "epoch_order", None)
        self.sampler = EpochBatchSampler(len(dataset), settings.batch_size, seed, self.rank, self.world_size, order_fn)
        self.batches_per_epoch = self.sampler.batches_per_epoch
        # Samples each epoch leaves out, over all ranks: those past its whole global batches (drop_last)
        self.dropped_records = len(dataset) % self.global_batch
        # Ranks draw different worker seeds. (torch's CPU generator keeps only the low 32 bits of a seed: mix them.)
        loader_seed = seed if self.rank == 0 else int(np.random.SeedSequence([seed, self.rank]).generate_state(1)[0])
        self.generator = torch.Generator().manual_seed(loader_seed)
        self.collate = CollateWithSnapshot(collate_fn or default_collate, capture_rng=rng_mode == "per_worker")
        self.streams, self.rotation, self.reuse = None, 0, False  # the class docstring says what they are

    @property
    def at_epoch_end(self) -> bool:
        """The batch just consumed is the epoch's last."""
        return self.position == self.batches_per_epoch

    @property
    def batches(self) -> int:
        """Global batches consumed over the run."""
        return self.epoch * self.batches_per_epoch + self.position

    def worker_due(self) -> int:
        """The worker that makes the batch the loop waits on next (a stall names it): batch `i` is worker
        `(i - rotation) % workers`'."""
        return (self.position - self.rotation) % self.settings.num_workers

    def _dataloader(self, generator: torch.Generator, persistent: bool) -> DataLoader:
        return GuardedDataLoader(
            self.dataset, self.settings, self.start_guard, batch_sampler=self.sampler, collate_fn=self.collate,
            worker_init_fn=SeedWorker(self.streams, self.rotation, self.worker_init, self.stack_dir),
            generator=generator, persistent_workers=persistent,
        )  # fmt: skip

    def begin(self):
        """The iterator of this epoch's batches from `position` on, on new workers where the class docstring says."""
        start, workers, persistent = self.position, self.settings.num_workers, self.settings.persistent_workers
        self.before = self.generator.get_state()  # as this iterator begins to draw a base seed
        self.sampler.set_epoch(self.epoch, start)
        if start and workers:
            self.rotation, self.reuse = start % workers, False
            return iter(self._dataloader(torch.Generator(), persistent=False))
        self.rotation = 0
        if not persistent:
            self.streams = None
        if self.loader is None or (persistent and not self.reuse):  # a non-persistent one seeds fresh workers anew
            self.loader = self._dataloader(self.generator, persistent)
        self.reuse = persistent
        return iter(self.loader)

    def consume(self, items):
        """The batches of `items`, each worker's RNG kept as its stream (rng_mode=per_worker)."""
        w = self.settings.num_workers
        # to the end, not just the last batch: a non-persistent iterator ends its workers there
        for batch, note in items:
            if note.rng is not None:
                if self.streams is None:  # fresh workers: worker `(s - rotation) % w` seeded itself from base_seed + it
                    self.streams = [rng.from_seed(note.base_seed + (s - self.rotation) % w) for s in range(w)]
                self.streams[self.position % w] = note.rng
            yield batch, note

    def own_state(self) -> dict:
        # per_sample seeds every sample afresh: the workers' streams carry nothing a resume needs
        streams = self.streams if self.settings.num_workers and self.rng_mode == "per_worker" else []
        return {
            "batches_per_epoch": self.batches_per_epoch,
            "persistent_workers": self.settings.persistent_workers,
            "generator": self.before if self._early is not None else self.generator.get_state(),
            "worker_streams": None if streams is None else [rng.to_saved(s) for s in streams],
        }

    def load_own(self, state: dict, strict: bool, reseed: int | None) -> None:
        """`reseed`: the run had another number of processes, so no rank's generator and worker streams carry over:
        the generator is seeded from `reseed` and the workers start fresh; the position (global batches of the epoch)
        carries over as it is."""
        # The batch order depends on these; with per_worker streams, so does which worker serves what.
        must_match = ["batches_per_epoch", "global_batch", "rng_mode"]
        if self.rng_mode == "per_worker" and reseed is None:
            must_match += ["num_workers", "persistent_workers"]
        changed = [f"{k} {state[k]} -> {v}" for k, v in self.state_dict().items() if k in must_match and state[k] != v]
        if changed:
            what = ", ".join(changed)
            if strict:
                raise UserError(
                    f"resume: the checkpoint's loader differs from this run's ({what}): resume with the same loader "
                    "settings and global batch to stay exact, or set resume_strict=false to go on with freshly "
                    "seeded workers"
                )
            log.warning("resume: loader changed (%s); workers are seeded afresh, so this run is no longer exact", what)
        self.position = min(self.position, self.batches_per_epoch)
        if reseed is None:
            self.generator.set_state(state["generator"])
        else:  # each rank its own, as a fresh run's ranks have; a function of (seed, rank, step)
            self.generator.manual_seed(reseed)
        # the next epoch's workers start from these streams (None: fresh)
        same = not changed and reseed is None and state["num_workers"] == self.settings.num_workers
        streams = state["worker_streams"]
        self.streams = [rng.from_saved(s) for s in streams] if same and streams else None
        self.reuse = False  # workers already running (a loader used before) carry other streams


{% if cookiecutter.with_streams == "yes" %}
class EvalStream(IterableDataset):
    """Validation of a stream: every record once, split over ranks and workers. A shard stream's shards go to the
    readers in their own order, whole; a plain stream splits itself."""

    def __init__(self, dataset, rank: int, world_size: int, seed: int | None = None):
        self.dataset, self.rank, self.world_size, self.seed = dataset, rank, world_size, seed

    def __iter__(self):
        if self.seed is None or not shard_plan.is_shard_stream(self.dataset):  # a plain stream: its own draws
            yield from shard_plan.records(self.dataset, self.rank, self.world_size)
            return
        # rng_mode=per_sample: each record seeded from (seed, shard, record), as SeededSamples seeds an indexed one's
        worker, workers = shard_plan.this_worker()
        base, shards = rng.epoch_base(self.seed, rng.VALIDATION), list(self.dataset.shards)
        pipelines = rng.own_generators(self.dataset)
        for shard in range(self.rank * workers + worker, len(shards), self.world_size * workers):
            records, index = iter(self.dataset.read(shards[shard])), 0
            while True:
                with rng.kept(get_worker_info() is None, cuda=False):  # the main process's RNG stays the loop's
                    rng.seed_sample(rng.index_seed(base, shard << 32 | index), pipelines)
                    record = next(records, records)  # the iterator itself: the shard has ended
                if record is records:
                    break
                yield record
                index += 1


{% endif %}
def eval_loader(
    dataset,
    settings: LoaderSettings,
    rank: int = 0,
    world_size: int = 1,
    worker_init=None,
    collate_fn=None,
    start_guard=contextlib.nullcontext,
    seed: int | None = None,
) -> DataLoader:
    """The validation loader, also built once (train.py's and eval.py's). Its own generator keeps the main RNG
{% if cookiecutter.with_streams == "yes" %}
    untouched. An indexed data set is read in order, each rank taking every `world_size`-th sample, each sample
    once; a stream (shard_plan.is_stream) through `EvalStream`, each worker batching its own records, so a rank's
    last batch of each worker may be short and the batches depend on the readers (processes x workers).
{% else %}
    untouched. The data set is read in order, each rank taking every `world_size`-th sample, each sample once.
{% endif %}

    `worker_init` is the DataLoader's `worker_init_fn` (train.py's keeps stop signals away from the workers), and
    `start_guard` is around its workers' start (GuardedDataLoader); `collate_fn` (`data.collate`, None: torch's
    default_collate) is the one the train loader uses. `seed` (rng_mode=per_sample's runs): each sample seeded from
    it and its index (SeededSamples{% if cookiecutter.with_streams == "yes" %}; a shard stream's records from it, their shard and place{% endif %});
    None: the data set draws from each worker's generators as they stand."""
    common = {"generator": torch.Generator(), "worker_init_fn": worker_init, "collate_fn": collate_fn}
{% if cookiecutter.with_streams == "yes" %}
    if shard_plan.is_stream(dataset):
        stream = EvalStream(dataset, rank, world_size, seed)
        return GuardedDataLoader(stream, settings, start_guard, batch_size=settings.batch_size, **common)
{% endif %}
    mine = range(rank, len(dataset), world_size)
    if not mine:
        raise UserError(
            f"the validation data has {len(dataset)} samples, too few for one on each of {world_size} processes: run "
            "fewer processes or give it more samples"
        )
    batches = BatchSampler(mine, settings.batch_size, drop_last=False)
    dataset = dataset if seed is None else SeededSamples(dataset, seed)
    return GuardedDataLoader(dataset, settings, start_guard, batch_sampler=batches, **common)
