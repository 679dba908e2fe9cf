"""Loader health while training: live workers, memory (RSS and PSS), open files, and how much of each step waits
on data.

- PSS, not RSS, is the figure to add up: workers fork from the main process and share its pages, which RSS counts
  once in every process that maps them and PSS splits between them (Linux; elsewhere psutil has no PSS: USS).
- A batch waiting in the loader's queue is a shared-memory file (`/dev/shm/torch_*`) that the worker holds open but
  no process has mapped yet, so it is in nobody's PSS: `shm_mib` counts those files, the measured counterpart of
  the prefetch plan (memory.py).
- A worker that dies is named with its signal or exit code (failures.worker_death). PyTorch's own SIGCHLD handler
  usually raises first ("DataLoader worker (pid N) is killed by signal: ..."); the check at each reading here
  covers the gaps.
"""

from __future__ import annotations

import glob
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor

import psutil

from .failures import ended_worker

log = logging.getLogger(__name__)
MiB = 2**20


def shared_batches(pids) -> int:
    """Bytes of PyTorch shared-memory files (batches in flight) held open by these processes, each file once."""
    seen = {}  # (device, inode) -> size: a file two processes hold counts once
    for pid in pids:
        for path in glob.glob(f"/proc/{pid}/fd/*"):  # none where there is no /proc, or the process is gone
            try:
                if "/torch_" not in os.readlink(path):
                    continue
                st = os.stat(path)
            except OSError:  # closed meanwhile
                continue
            seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


def _readings() -> dict[int, tuple[int, int, int]]:
    """{pid: (RSS, PSS (else USS), open files)} for this process, then each live child process, all generations; one
    that exits meanwhile is skipped."""
    main = psutil.Process()
    found = {}
    for proc in (main, *main.children(recursive=True)):
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                info = proc.memory_full_info()
                fds = proc.num_fds() if hasattr(proc, "num_fds") else proc.num_handles()
                found[proc.pid] = info.rss, getattr(info, "pss", getattr(info, "uss", info.rss)), fds
        except (psutil.NoSuchProcess, psutil.AccessDenied):  # exited between the listing and the reading
            continue
    return found


def pss_mib(leave_out=frozenset()) -> float:
    """PSS of this process and its live children but those in `leave_out`, in MiB: the light reading polled
    for a peak."""
    return sum(pss for pid, (_, pss, _) in _readings().items() if pid not in leave_out) / MiB


def sample(worker_pids: set[int]) -> dict:
    """One reading of this process and its children. `workers_*` and `fds` cover every live child process: the
    train loader's workers, the persistent validation workers and anything a dataset spawned; all of it is memory
    the run holds. `worker_count` counts only the train loader's workers (`worker_pids`, filled from the batches)."""
    readings = _readings()
    main_rss, main_pss, _ = readings[os.getpid()]
    rss, pss, fds = map(sum, zip(*readings.values()))
    return {
        "worker_count": len(readings.keys() & worker_pids),
        "rss_mib": rss / MiB,
        "pss_mib": pss / MiB,
        "main_rss_mib": main_rss / MiB,
        "main_pss_mib": main_pss / MiB,
        "workers_rss_mib": (rss - main_rss) / MiB,
        "workers_pss_mib": (pss - main_pss) / MiB,
        "fds": fds,
        "shm_mib": shared_batches(readings) / MiB,
    }


class Monitor:
    """Samples health every `every_steps` steps and at the last batch of each epoch (while the epoch's workers still
    live); writes TensorBoard scalars under `health/` and hands the epoch figures to metrics.jsonl. Readings run off
    the loop, in a thread of their own (reading smaps_rollup makes the kernel walk each process's page tables, ~10 ms
    for a process holding PyTorch), and are written once done (at the latest at the epoch's end). `runlog.enabled`
    is False on ranks other than 0: those sample but write nothing."""

    def __init__(self, loader, runlog, every_steps: int):
        self.loader = loader
        self.runlog = runlog
        self.every = every_steps
        self.plan = None  # memory.Plan, set from the first batch
        self._epoch = None  # the epoch the window belongs to
        self._mark = None  # (step, cumulative data wait, time) at the window's start, from an epoch's first step
        self._readings = ThreadPoolExecutor(1, thread_name_prefix="health-sample")
        self._pending = []  # (step, window figures or None: the plan's, the reading's Future)
        self._epoch_end = None  # the Future of the reading at the epoch's last batch
        self._steps_seen = 0
        self._measured = False  # the plan against a reading, logged once
        self.budget_mib = None  # loader=auto's loader.ram_budget_mib: a reading past it is said once

    def set_plan(self, plan) -> None:
        self.plan = plan
        if self.runlog.enabled:
            log.info(plan.line())

    def step(self, step: int, data_wait: float, started: float) -> None:
        """Call once per step with the epoch's cumulative data wait and its start time (perf_counter)."""
        if self._epoch != self.loader.epoch:  # first step of an epoch: the window starts at the epoch start
            self._epoch = self.loader.epoch
            self._mark = (step - 1, 0.0, started)
            self._epoch_end = None
        self._steps_seen += 1
        self._write_done()
        last = self.loader.at_epoch_end
        if self.plan is not None and not self._measured and self.runlog.enabled:
            # once, after warm-up: the queue has turned over twice and a full queue's worth of the epoch is left
            in_flight = self.plan.in_flight
{% if cookiecutter.with_streams == "yes" %}
            known = self.loader.batches_per_epoch  # None: a stream without sizes
            left = in_flight if known is None else known - self.loader.position
{% else %}
            left = self.loader.batches_per_epoch - self.loader.position
{% endif %}
            if self._steps_seen >= 2 * in_flight + 2 and left >= in_flight:
                self._measured = True
                self._pending.append((step, None, self._reading()))
        if not (last or (self.every and step % self.every == 0)):
            return
        now = time.perf_counter()
        if died := ended_worker(self.loader.worker_pids):
            raise died
        start_step, start_wait, start_time = self._mark
        steps = step - start_step
        wait = data_wait - start_wait
        elapsed = now - start_time
        self._mark = (step, data_wait, now)
        window = {
            "wait_ms_per_step": 1000 * wait / steps,
            "compute_ms_per_step": 1000 * (elapsed - wait) / steps,
            "data_wait_share": wait / elapsed if elapsed > 0 else 0.0,
        }
        reading = self._reading()
        self._pending.append((step, window, reading))
        self._epoch_end = reading if last else None
        if last:  # read before the loop asks for the next batch: workers that are not kept (a profile that frees them
            self._write_done(wait=True)  # each epoch, the one-off ones of a mid-epoch resume) exit then

    def _reading(self) -> Future:
        return self._readings.submit(sample, set(self.loader.worker_pids))

    def _write_done(self, wait: bool = False) -> None:
        """Write the readings that have finished (all of them, waiting, with `wait`): one thread takes them in
        order, so they finish in order."""
        while self._pending and (wait or self._pending[0][2].done()):
            step, window, reading = self._pending.pop(0)
            figures = reading.result()  # on every rank: `wait` means read before the workers exit
            held = figures["pss_mib"] + figures["shm_mib"]
            if self.budget_mib is not None and held > self.budget_mib:  # each rank against its own budget
                line = (
                    "loader=auto: this process, its workers and the batches in shared memory hold %.0f MiB "
                    "at step %d, over loader.ram_budget_mib=%.0f: the data set's memory grew after the trials; "
                    "lower loader.num_workers for the next run, or raise the budget"
                )
                log.warning(line, held, step, self.budget_mib)
                self.budget_mib = None
            if not self.runlog.enabled:
                continue
            if window is None:
                log.info(
                    "prefetch plan {plan:.1f} MiB; measured at step {step}: {shm_mib:.1f} MiB of batches in shared "
                    "memory (those in flight and the one in training), PSS main {main_pss_mib:.0f} MiB + workers "
                    "{workers_pss_mib:.0f} MiB = {pss_mib:.0f} MiB (RSS {rss_mib:.0f} MiB)".format(
                        plan=self.plan.mib, step=step, **figures
                    )
                )
            else:
                self.runlog.scalars("health", {**figures, **window}, step)

    def epoch(self, data_wait: float, train_time: float, page_faults_per_batch: float | None) -> dict:
        """The epoch's keys for metrics.jsonl: the reading at its last batch, its data wait share, and the main
        process's page faults per batch (None where the OS does not count them)."""
        self._write_done(wait=True)
        reading = self._epoch_end.result() if self._epoch_end else sample(self.loader.worker_pids)
        record = {key: round(reading[key], 1) for key in ("worker_count", "rss_mib", "pss_mib", "fds")}
        record |= {
            "data_wait_share": data_wait / train_time if train_time > 0 else 0.0,
            "bad_samples": self.loader.skipped,  # left out by data.on_bad_sample=skip (listed in bad_samples.txt)
            "dropped_records": self.loader.dropped_records,  # past the epoch's whole (global, lockstep) batches
            "page_faults_per_batch": None if page_faults_per_batch is None else round(page_faults_per_batch, 1),
        }
        if self.runlog.enabled:
            faults = "" if page_faults_per_batch is None else f", {page_faults_per_batch:.0f} page faults per batch"
            share = record["data_wait_share"]
            log.info(
                "health: {worker_count} workers, PSS {pss_mib:.0f} MiB (main {main_pss_mib:.0f} + workers "
                "{workers_pss_mib:.0f}), RSS {rss_mib:.0f} MiB, {fds} fds, {shm_mib:.1f} MiB batches in shared "
                "memory, data wait {share:.0%} of the epoch{faults}".format(**reading, share=share, faults=faults)
            )
        return record
