"""loader=auto: the loader settings picked by short trials on the run's own training data and model step,
under a RAM and a CPU budget, before the run's one DataLoader is built (docs/loader.md, "loader=auto").

A loader key set to `tune` is picked here; any other value is kept. A trial builds the run's kind of train
loader with one candidate's settings over an evenly spaced part of the training set and runs the model's
forward and backward on each batch (a model of its own: the run's model, optimizer and generators are
untouched). It is scored on the loop's wait for data. The workers climb while more of them help, the prefetch
is tried around the best, and the pick is the cheapest trial within WITHIN of the fastest. A candidate whose
plan passes a budget is never tried; a trial whose measured peak passes it is never picked."""

from __future__ import annotations

import gc
{% if cookiecutter.with_streams == "yes" %}
import itertools
{% endif %}
import logging
import math
import os
import statistics
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import psutil
import torch
from torch.utils.data import Dataset, get_worker_info

from . import memory, monitor, parts, rng{% if cookiecutter.with_streams == "yes" %}, shard_plan{% endif +%}
from .data_check import first_samples
from .device import to_device
from .errors import UserError
from .loader import LoaderSettings, TrainLoader, usable_cpus
{% if cookiecutter.with_streams == "yes" %}
from .stream_loader import StreamLoader
{% endif %}
from .task_results import split_loss

log = logging.getLogger(__name__)

MiB = 2**20
TUNE = "tune"  # a loader key with this value is picked by the trials
TUNED = ("num_workers", "prefetch_factor", "persistent_workers", "pin_memory")
# ram_budget_mib=null: this share of the memory available at start, split over this node's ranks
RAM_SHARE = 0.5
WITHIN = 0.02  # the pick: the cheapest trial whose speed is within this share of the fastest
HELPS = 1.05  # more workers help when they are this much faster; a step that is not ends the climb
FLAT = 0.9  # a neighbour this close below the best: a rung between them may be as fast, and cheaper
LIGHT = 0.05  # batches in flight under this share of the RAM budget: fewer of them is not worth a trial
DONE_WAIT = 0.01  # a data wait below this share of the step: nothing left for more workers to hide
BUSY = 0.9  # the workers and this process use this share of the CPU budget: more workers would only take CPU
WORKERS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # the climb's rungs
TRIAL_S = 1.0  # a trial's timed part at most (after its first batch)
# a trial is run only while it costs less than this share of the time the run would still wait for data
# at the best setting so far (its length from the fastest trial, its wait the least): what more trials could
# save at most
PAYBACK = 0.5
PSS_EVERY_S = 0.2  # PeakPss's shortest wait between readings


class Probe(Dataset):
    """The part of the data set a trial reads, each item timed in the process that makes it: `count` evenly
{% if cookiecutter.with_streams == "yes" %}
    spaced items, or a stream's first `count` records (a shard stream's shards split over the workers, any
    other stream splitting itself). `collate`: the run's, plus the worker's first-item figures riding
    along."""
{% else %}
    spaced items. `collate`: the run's, plus the worker's first-item figures riding along."""
{% endif %}

    def __init__(self, dataset, count: int, collate):
        self.dataset, self.count, self.collate_fn = dataset, count, collate
        # each item made in this process: (time.time() it began, seconds)
        self.times: list[tuple[float, float]] = []
{% if cookiecutter.with_streams == "yes" %}
        # a stream is read from its start: nothing to pick
        size = 0 if shard_plan.is_stream(dataset) else len(dataset)
{% else %}
        size = len(dataset)
{% endif %}
        self.picks = np.linspace(0, size - 1, min(size, count)).round().astype(np.int64).tolist()

    def __len__(self) -> int:
        return len(self.picks)

    def data_index(self, index: int) -> int:
        """The data set's index of item `index`: a failing sample is named by it, as in the run."""
        return self.picks[index]

    def sample_source(self, index: int) -> str:
        return self.dataset.sample_source(self.picks[index])  # without one: AttributeError, no source

    def __getitem__(self, index):
        began = time.time()
        item = self.dataset[self.picks[index]]
        self.times.append((began, time.time() - began))
        return item
{% if cookiecutter.with_streams == "yes" %}

    def __iter__(self):
        workers = shard_plan.this_worker()[1]
        records = itertools.islice(shard_plan.records(self.dataset), max(self.count // workers, 1))
        while (began := time.time()) and (item := next(records, None)) is not None:  # began: before each read
            self.times.append((began, time.time() - began))
            yield item
{% endif %}

    def collate(self, samples):
        """The batch, and (worker pid, when its first item began by the wall clock, which processes share, how
        much longer that item took than the later ones) from a worker; None from the main process."""
        if get_worker_info() is None or not self.times:
            return self.collate_fn(samples), None
        (began, first), later = self.times[0], [took for _, took in self.times[1:]]
        slower = max(first - statistics.median(later or [0.0]), 0.0)
        return self.collate_fn(samples), (os.getpid(), began, slower)


def probe_loader(dataset, settings: LoaderSettings, count: int, collate, seed: int, rng_mode="per_sample",
                 skip: bool = False):  # fmt: skip
    """The run's kind of train loader over a Probe of `count` samples, with `settings`: the data read as
    train.py reads it (`skip`: data.on_bad_sample=skip leaves a failing sample out, as the run will)."""
    probe = Probe(dataset, count, collate)
{% if cookiecutter.with_streams == "yes" %}
    if shard_plan.is_stream(dataset):
        return StreamLoader(probe, settings, seed=seed, collate_fn=probe.collate)
{% endif %}
    bad = "skip" if skip else "error"
    return TrainLoader(probe, settings, seed=seed, rng_mode=rng_mode, collate_fn=probe.collate,
                       on_bad_sample=bad)  # fmt: skip


class PeakPss(threading.Thread):
    """Polls the PSS of this process and its children (with `queue`, the batches waiting in shared memory too,
    which are in no process's PSS) until `result()`, keeping the highest reading. A reading costs ~10 ms of
    kernel time per process (smaps_rollup walks the page tables): each poll waits ten times the last one's, a
    tenth of a core."""

    def __init__(self, queue: bool = False, leave_out=frozenset()):
        super().__init__(daemon=True)
        self.queue, self.leave_out, self.peak, self.stop = queue, leave_out, 0.0, threading.Event()
        self.start()

    def reading(self) -> float:
        pss = monitor.pss_mib(self.leave_out)
        if not self.queue:
            return pss
        kids = psutil.Process().children(recursive=True)
        pids = [os.getpid()] + [c.pid for c in kids if c.pid not in self.leave_out]
        return pss + monitor.shared_batches(pids) / MiB

    def run(self) -> None:
        wait = PSS_EVERY_S
        while not self.stop.wait(wait):
            began = time.perf_counter()
            self.peak = max(self.peak, self.reading())
            wait = max(PSS_EVERY_S, 10 * (time.perf_counter() - began))

    def result(self) -> float:
        """Stops polling: the peak, a last reading included."""
        self.stop.set()
        self.join()
        return max(self.peak, self.reading())


def children() -> set[int]:
    """The pids of this process's live children, all generations."""
    return {c.pid for c in psutil.Process().children(recursive=True)}


def workers_gone(leave_out=frozenset(), seconds: float = 10) -> None:
    """A loader collected, its workers (the children not in `leave_out`) waited for: the DataLoader iterator
    shuts them down when collected."""
    gc.collect()
    deadline = time.time() + seconds
    while children() - leave_out and time.time() < deadline:
        time.sleep(0.05)


class ModelStep:
    """The model's forward and backward on a batch as the loop makes it (to the device, data.normalize), on a
    model of its own built as the run builds it: the run's model, optimizer and generators stay as they are.
    """

    def __init__(self, cfg, device: torch.device):
        with rng.kept():  # the model's initialisation draws from the main RNG; leave it as it was
            self.model, self.task = parts.model(cfg.model, device), parts.build(cfg.task, "task")
        self.device, self.prepare = device, parts.prepare(cfg.data, device, False)

    def __call__(self, batch) -> None:
        batch = self.prepare(to_device(batch, self.device))
        self.model.zero_grad(set_to_none=True)
        split_loss(self.task.loss(self.model, batch))[0].backward()  # a bare loss or (loss, parts)

    def sync(self) -> None:
        """Wait for the device to finish what was asked."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def batches_per_s(self, dataset, collate, batch_size: int, steps: int = 5) -> float:
        """The model's pace on one batch made from the first samples (the pace the loader must keep)."""
        with rng.kept():
            # as the dry step reads them (streams too)
            samples = first_samples(dataset, "data.train", batch_size)
            batch = collate([samples[i % len(samples)] for i in range(batch_size)])
        for i in range(steps + 2):  # two warm-up steps, then the timed ones
            if i == 2:
                self.sync()
                began = time.perf_counter()
            self(batch)
        self.sync()
        return steps / (time.perf_counter() - began)


def workers_cpu_s(leave_out: set[int]) -> float:
    """CPU seconds (user and system) the live children of this process but those in `leave_out` have used."""
    total = 0.0
    for child in psutil.Process().children(recursive=True):
        if child.pid in leave_out:
            continue
        try:
            times = child.cpu_times()
            total += times.user + times.system
        except psutil.Error:  # exited meanwhile
            continue
    return total


@dataclass
class Budget:
    """What the trials and the pick may use on this rank: MiB of measured peak PSS (batches in flight and
    pinned copies included), CPUs for the workers, seconds of trials."""

    ram_mib: float
    cpus: int
    tune_s: float

    @classmethod
    def of(cls, loader_cfg) -> Budget:
        """From loader.ram_budget_mib, cpu_budget and tune_s, null defaults settled; bad values refused."""
        ranks, cpus = memory.local_ranks(), usable_cpus()
        ram = loader_cfg.ram_budget_mib
        if ram is None:
            ram = RAM_SHARE * psutil.virtual_memory().available / MiB / ranks
        cpu = loader_cfg.cpu_budget if loader_cfg.cpu_budget is not None else max(cpus // ranks, 1)
        if cpu > cpus:
            raise UserError(
                f"loader.cpu_budget={cpu} is more than the {cpus} CPUs this process may use: "
                f"set it to at most {cpus}, or null (the usable CPUs split over this node's processes)"
            )
        return cls(float(ram), int(cpu), float(loader_cfg.tune_s))


@dataclass
class Trial:
    """One candidate's measured figures."""

    num_workers: int
    prefetch_factor: int | None
    pin_memory: bool
    samples_per_s: float
    data_wait: float  # the share of the loop's time spent waiting for the next batch
    peak_pss_mib: float  # main process, workers and the batches in shared memory, at their peak
    workers_cpu: float  # cores the workers used on average
    main_cpu: float  # cores this process used on average (the step's threads, the pin thread)
    # the CPU share of the loop's wait (num_workers=0: how busy a loading process keeps a core)
    loading_cpu: float
    seconds: float
    over: str | None = None  # why it may not be picked (its measured peak past the budget)

    def line(self) -> str:
        pin = " pin_memory=true" if self.pin_memory else ""
        return (
            f"num_workers={self.num_workers} prefetch_factor={self.prefetch_factor}{pin}: "
            f"{self.samples_per_s:.0f} samples/s, data wait {self.data_wait:.0%}, "
            f"peak PSS {self.peak_pss_mib:.0f} MiB, workers' CPU {self.workers_cpu:.1f}"
        )


@dataclass
class Pick:
    """The settings the run's loader is built with, what picked them, and what they need of a machine."""

    settings: LoaderSettings
    why: str
    trials: list = field(default_factory=list)
    skipped: list = field(default_factory=list)  # candidates never tried, and why
    needs: dict = field(default_factory=dict)  # {"cpus": workers' measured CPU use, "ram_mib": measured peak}
    budget: dict = field(default_factory=dict)
    kept: dict = field(default_factory=dict)  # the loader keys set beside auto, kept as they are
    tuned_s: float = 0.0
    from_checkpoint: bool = False

    def saved(self) -> dict:
        """What a checkpoint carries (the loader's state) and loader_pick.json holds."""
        out = asdict(self)
        out["trials"] = [asdict(t) if isinstance(t, Trial) else t for t in self.trials]
        return out

    @classmethod
    def from_saved(cls, saved: dict) -> Pick:
        return cls(**{**saved, "settings": LoaderSettings(**saved["settings"]), "from_checkpoint": True})


def tuned_keys(loader_cfg) -> list[str]:
    """The loader keys the trials pick (their value is `tune`)."""
    return [k for k in TUNED if loader_cfg[k] == TUNE]


def measure(settings: LoaderSettings, dataset, collate, step: ModelStep, seed: int, rng_mode: str,
            seconds: float, skip: bool = False) -> Trial:  # fmt: skip
    """One trial: the batches of a probe through the model's step, the wait for each timed; the first batch
    (the workers' start) is not counted. Ends after enough batches that the queue turns over a few times, or
    `seconds`."""
    batches = max(12, 3 * settings.num_workers * (settings.prefetch_factor or 0) + 8)
    loader = probe_loader(dataset, settings, batches * settings.batch_size, collate, seed, rng_mode, skip)
    others = children()  # processes that are not the trial's (a tracker's, a test's): in no figure of it
    peak, began = PeakPss(queue=True, leave_out=others), time.perf_counter()
    # num_workers=0 loads in this process: its draws are put back. More workers than cores is a rung of the
    # climb: DataLoader's warning about it (check_worker_number_rationality) is not for the trials.
    with rng.kept(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)
        items, item = iter(loader), None
        step(next(items)[0])
        cpu, main, start = workers_cpu_s(others), time.process_time(), time.perf_counter()
        waited, count = 0.0, 0
        loading = 0.0  # this thread's CPU seconds inside next(): the loading itself when num_workers=0
        while time.perf_counter() - start < seconds:
            asked, used = time.perf_counter(), time.thread_time()
            item = next(items, None)
            if item is None:
                break
            waited += time.perf_counter() - asked
            loading += time.thread_time() - used
            step(item[0])
            count += 1
        step.sync()
        span = time.perf_counter() - start
        cpu = (workers_cpu_s(others) - cpu) / span if span > 0 else 0.0
        main = (time.process_time() - main) / span if span > 0 else 0.0
        del items, item
    peak_mib = peak.result()
    del loader
    workers_gone(others)
    speed, wait = (count * settings.batch_size / span, waited / span) if span > 0 else (0.0, 1.0)
    loading_cpu = loading / waited if waited > 0 else 1.0
    seconds = time.perf_counter() - began
    figures = speed, wait, peak_mib, cpu, main, loading_cpu, seconds
    return Trial(settings.num_workers, settings.prefetch_factor, settings.pin_memory, *figures)


def next_rung(t: Trial) -> int | None:
    """The climb's next worker count after trial `t`: as many more as its wait suggests (a loop waiting 75% of
    the time wants about 4x the workers), 1.5x to 4x (1 to 4 after the main process), on a rung of WORKERS;
    None past the last rung."""
    if not t.num_workers:  # loading takes data_wait of the main process's time: so many workers hide it
        return next(w for w in WORKERS if w >= min(4.0, max(1.0, t.data_wait / max(1 - t.data_wait, 0.01))))
    grow = min(4.0, max(1.5, 1 / max(1 - t.data_wait, 0.25)))
    return next((w for w in WORKERS if w >= t.num_workers * grow), None)


def cost(t) -> tuple:
    """Cheaper first: fewer workers, fewer batches ahead, no pinned copies."""
    return t.num_workers, t.prefetch_factor or 0, t.pin_memory


def tune(dataset, collate, step: ModelStep, base: LoaderSettings, tuned: list[str], budget: Budget, seed: int,
         rng_mode: str = "per_sample", run_batches: int | None = None, say=log.info,
         skip: bool = False) -> Pick:  # fmt: skip
    """Trials, each said in one line (`say`), and the pick: the climb of num_workers at the base prefetch,
    then prefetch_factor around the fastest, then (CUDA) pin_memory; the keys not in `tuned` stay as `base`
    has them. `run_batches`: the batches the run will take (None: not known), whose wait for data bounds the
    trials (PAYBACK); `skip`: data.on_bad_sample=skip."""
    began, batch = time.perf_counter(), memory.sample_batch_bytes(dataset, base.batch_size, collate)
    if batch / MiB > budget.ram_mib:
        raise UserError(
            f"loader=auto: one batch of {base.batch_size} needs {batch / MiB:.1f} MiB, "
            f"over loader.ram_budget_mib={budget.ram_mib:g}: raise the budget or lower loader.batch_size"
        )
    # the plan's figures, measured as the trials run
    main_mib, per_worker, worker_cpu = monitor.pss_mib(children()), 0.0, 1.0
    space = memory.shm_space()
    trials, skipped = [], []

    def planned(s: LoaderSettings) -> str | None:
        """Why `s` would pass a budget by the plan (None: it fits): RAM, /dev/shm, CPU."""
        plan = memory.Plan(s, batch)
        ram = main_mib + s.num_workers * per_worker + plan.mib
        if ram > budget.ram_mib:
            return f"its plan needs ~{ram:.0f} MiB, over the RAM budget of {budget.ram_mib:.0f} MiB"
        if space is not None and s.num_workers and plan.shm_need(memory.local_ranks()) > space[0]:
            need = plan.shm_need(memory.local_ranks()) / MiB
            return f"its batches need {need:.0f} MiB of {memory.SHM_DIR}, {space[0] / MiB:.0f} MiB free"
        if s.num_workers * worker_cpu > budget.cpus + 0.5:
            use = s.num_workers * worker_cpu
            return f"its workers would use ~{use:.1f} CPUs, over the budget of {budget.cpus}"
        return None

    def attempt(s: LoaderSettings) -> Trial | None:
        nonlocal main_mib, per_worker, worker_cpu
        left = budget.tune_s - (time.perf_counter() - began)
        if left <= 0 and trials:
            return None
        fastest = max((t.samples_per_s for t in trials), default=0.0)
        if run_batches and fastest:  # a short run, or one that hardly waits, affords few trials
            # at the best so far
            waits = min(t.data_wait for t in trials) * run_batches * base.batch_size / fastest
            if PAYBACK * waits < trials[-1].seconds:
                return None
        if why := planned(s):
            passed = {"num_workers": s.num_workers, "prefetch_factor": s.prefetch_factor, "why": why}
            if passed in skipped:
                return None
            skipped.append(passed)
            say("loader=auto: num_workers=%d prefetch_factor=%s not tried: %s", *passed.values())
            return None
        t = measure(s, dataset, collate, step, seed, rng_mode, max(min(left, TRIAL_S), 0.5), skip)
        if t.peak_pss_mib > budget.ram_mib:
            t.over = f"peak PSS {t.peak_pss_mib:.0f} MiB, over the budget of {budget.ram_mib:.0f} MiB"
        if s.num_workers:  # what one more worker costs, for the next plan (CPU: as the most workers used)
            in_flight = memory.Plan(s, batch).mib
            per_worker = max(per_worker, (t.peak_pss_mib - main_mib - in_flight) / s.num_workers)
            if s.num_workers >= max(tr.num_workers for tr in trials):
                worker_cpu = max(t.workers_cpu / s.num_workers, 0.05)
        else:  # a worker would keep a core as busy as loading kept this process's
            main_mib, worker_cpu = max(main_mib, t.peak_pss_mib), max(t.loading_cpu, 0.05)
        trials.append(t)
        say("loader=auto trial %d: %s%s", len(trials), t.line(), f" ({t.over})" if t.over else "")
        return t

    def settings(workers: int, prefetch, pin: bool) -> LoaderSettings:
        s = replace(base, num_workers=workers, prefetch_factor=prefetch, pin_memory=pin)
        return s if workers else s.in_main()

    def busy(t: Trial) -> bool:  # the CPU, not the reads, is the limit: more workers would only take CPU
        return t.num_workers > 0 and t.workers_cpu + t.main_cpu >= BUSY * budget.cpus

    pin = base.pin_memory
    prefetch = base.prefetch_factor or 2
    workers, best = (0 if "num_workers" in tuned else base.num_workers), None
    while workers is not None:  # the climb: up while a rung is HELPS faster than the best so far
        t = attempt(settings(workers, prefetch, pin))
        if t is None:
            break
        helped = best is None or t.samples_per_s >= HELPS * best.samples_per_s
        if helped and t.over is None:
            best = t
        if t.over or not helped or busy(t) or t.data_wait < DONE_WAIT or "num_workers" not in tuned:
            break
        target = next_rung(t) or t.num_workers  # past its budgets, the most workers on the way to it that fit
        way = [w for w in WORKERS if t.num_workers < w <= target]
        fits = [w for w in way if planned(settings(w, prefetch, pin)) is None]
        if target not in fits[-1:] and target > t.num_workers:
            attempt(settings(target, prefetch, pin))  # not tried: said, and listed among the skipped
        workers = fits[-1] if fits else None

    def by_workers(n: int) -> float:
        return max(t.samples_per_s for t in trials if t.num_workers == n)

    if best is not None:  # one rung between the best and a tried neighbour: a cheaper one, or a faster one
        w, spans = best.num_workers, []
        below = [t.num_workers for t in trials if t.num_workers < w]
        above = [t.num_workers for t in trials if t.num_workers > w]
        # the speed flattens out below the best
        if below and by_workers(max(below)) >= FLAT * best.samples_per_s:
            spans.append((max(below), w))
        if above:
            spans.append((w, min(above)))
        for low, high in spans:
            between = [n for n in WORKERS if low < n < high]
            if between:
                attempt(settings(between[len(between) // 2], prefetch, pin))
    ok = [t for t in trials if t.over is None]
    if not ok:
        lean = min(trials, key=lambda t: t.peak_pss_mib, default=None)
        seen = f"; the leanest setting tried peaks at {lean.peak_pss_mib:.0f} MiB" if lean else ""
        raise UserError(
            f"loader=auto: no setting fits loader.ram_budget_mib={budget.ram_mib:.0f}{seen}: "
            "raise the budget to "
            f"{(lean.peak_pss_mib if lean else main_mib) * 1.2:.0f} or more, or lower loader.batch_size"
        )
    fastest = max(ok, key=lambda t: t.samples_per_s)
    around = min((t for t in ok if t.samples_per_s >= (1 - WITHIN) * fastest.samples_per_s), key=cost)
    if "prefetch_factor" in tuned and around.num_workers:
        # fewer batches ahead where they weigh on the budget; more where the wait shows and more workers
        # cannot hide it: a budget held them back, or the CPUs are busy (a deeper queue evens out the pace)
        in_flight = memory.Plan(settings(around.num_workers, around.prefetch_factor, pin), batch).mib
        held = any("CPUs" not in passed["why"] for passed in skipped) or busy(around)  # RAM, /dev/shm or CPUs
        for p in [1] * (in_flight > LIGHT * budget.ram_mib) + [4] * (held and around.data_wait > DONE_WAIT):
            if p != around.prefetch_factor:
                attempt(settings(around.num_workers, p, pin))
    if "pin_memory" in tuned and pin and around.num_workers:  # CUDA: the copies without pinning
        attempt(settings(around.num_workers, around.prefetch_factor, False))
    ok = [t for t in trials if t.over is None]
    fastest = max(ok, key=lambda t: t.samples_per_s)
    chosen = min((t for t in ok if t.samples_per_s >= (1 - WITHIN) * fastest.samples_per_s), key=cost)
    persistent = base.persistent_workers if "persistent_workers" not in tuned else True
    picked = settings(chosen.num_workers, chosen.prefetch_factor, chosen.pin_memory)
    picked = replace(picked, persistent_workers=persistent and chosen.num_workers > 0)
    fewer = [t for t in ok if t.num_workers < chosen.num_workers]
    below = max(fewer, key=lambda t: (t.num_workers, t.samples_per_s), default=None)
    than = f" ({below.num_workers} workers: {below.data_wait:.0%})" if below else ""
    why = (
        f"num_workers={picked.num_workers} prefetch_factor={picked.prefetch_factor}: "
        f"data wait {chosen.data_wait:.0%}"
        f"{than}, {chosen.samples_per_s:.0f} samples/s ({fastest.samples_per_s:.0f} the fastest), peak PSS "
        f"{chosen.peak_pss_mib / 1024:.2f} of {budget.ram_mib / 1024:.2f} GiB"
    )
    needs = {"cpus": chosen.workers_cpu, "ram_mib": chosen.peak_pss_mib}
    return Pick(picked, why, trials, skipped, needs, asdict(budget), tuned_s=time.perf_counter() - began)


def short_of(pick: Pick, budget: Budget) -> str | None:
    """What this machine lacks for a saved pick (None: it fits)."""
    if pick.needs.get("ram_mib", 0) > budget.ram_mib:
        return f"it peaked at {pick.needs['ram_mib']:.0f} MiB, this budget is {budget.ram_mib:.0f} MiB"
    if math.floor(pick.needs.get("cpus", 0)) > budget.cpus:
        return f"its workers used {pick.needs['cpus']:.1f} CPUs, this budget is {budget.cpus}"
    return None


def choose(cfg, problem, device: torch.device, base: LoaderSettings, ckpt: dict | None, world) -> Pick:
    """The run's pick: a resume's checkpoint's, without trials, where this machine affords it
{% if cookiecutter.with_streams == "yes" %}
    (rng_mode=per_worker and a plain stream keep it whatever: their batches depend on the workers); else the
    trials'."""
{% else %}
    (rng_mode=per_worker keeps it whatever: its batches depend on the workers); else the trials'."""
{% endif %}
    tuned, budget = tuned_keys(cfg.loader), Budget.of(cfg.loader)
    rank = f"rank {world.rank}: " if world.world_size > 1 else ""
    if rank:  # each rank tunes for itself and says so, where the others' lines are only their problems
        log.setLevel(logging.INFO)

    def say(line: str, *args) -> None:
        log.info(rank + line, *args)

    kept = {k: cfg.loader[k] for k in TUNED if k not in tuned}
    if kept:
        say("loader=auto: %s kept as set; tuning %s", " ".join(f"{k}={v}" for k, v in kept.items()),
                 ", ".join(tuned))  # fmt: skip
    states = ckpt["ranks"] if ckpt else []
    state = states[min(world.rank, len(states) - 1)]["loader"] if states else {}
    if state.get("pick"):
        pick = Pick.from_saved(state["pick"])
        settings = replace(pick.settings, batch_size=base.batch_size, timeout=base.timeout)  # this run's
        pick.settings = settings if settings.num_workers else settings.in_main()
        pick.budget = asdict(budget)  # this run's, which training is held to
        short = short_of(pick, budget)
        keep = cfg.rng_mode.value == "per_worker"
{% if cookiecutter.with_streams == "yes" %}
        keep = keep or state["kind"] == "stream"
{% endif %}
        if short is None or keep:
            also = f" (this machine is short of it: {short}; kept, as the batches depend on it)"
            say("loader=auto: the checkpoint's pick, no trials: %s%s", pick.why, also if short else "")
            return pick
        line = "loader=auto: the checkpoint's pick does not fit this machine (%s): tuning again"
        log.warning(rank + line, short)
    collate = problem.collate or torch.utils.data.default_collate
    run_batches = batches_of_run(cfg, problem.train_set, base.batch_size, world.world_size)
    step = ModelStep(cfg, device)
    mode = cfg.rng_mode.value
    skip = cfg.data.get("on_bad_sample", "error") == "skip"
    pick = tune(problem.train_set, collate, step, base, tuned, budget, cfg.seed, mode, run_batches, say, skip)
    pick.kept = kept
    say("loader=auto picks %s (%d trials, %.1f s)", pick.why, len(pick.trials), pick.tuned_s)
    return pick


def batches_of_run(cfg, dataset, batch_size: int, world_size: int = 1) -> int | None:
    """The batches a run of `cfg` takes on each rank, which bounds its trials (None: a stream's, not known
    ahead)."""
{% if cookiecutter.with_streams == "yes" %}
    if shard_plan.is_stream(dataset):
        return None
{% endif %}
    batches = cfg.epochs * (len(dataset) // (batch_size * world_size))
    return min(batches, cfg.max_steps * cfg.accumulate_steps) if cfg.max_steps else batches


def pick_file(rank: int) -> str:
    """The run folder's record of a rank's pick and trials."""
    return "loader_pick.json" if rank == 0 else f"loader_pick.rank{rank}.json"
