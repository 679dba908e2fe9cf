"""Loader health while training: live workers, memory (RSS and PSS), open files, and how much of each step waits
on data.

- PSS, not RSS, is the figure to add up: workers fork from the main process and share its pages,
  and RSS counts a shared page once in every process that maps it. PSS splits each shared page
  between them, so PSS summed over main + workers is what the run really holds (Linux; elsewhere
  psutil has no PSS and USS is used).
- A batch waiting in the loader's queue is a shared-memory file (`/dev/shm/torch_*`) that the
  worker holds open but no process has mapped yet, so it is in nobody's PSS. `shm_mib` counts those
  files directly: it is the measured counterpart of the prefetch plan (memory.py).
- A worker that dies is named with its signal or exit code. PyTorch's own SIGCHLD handler usually
  raises first ("DataLoader worker (pid N) is killed by signal: ..."); the check here covers the gaps.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
import time

import psutil

from .errors import causes
from .failures import shm_full

log = logging.getLogger(__name__)

MiB = 2**20


def _memory(proc: psutil.Process) -> tuple[int, int]:
    info = proc.memory_full_info()
    return info.rss, getattr(info, "pss", getattr(info, "uss", info.rss))


def _fds(proc: psutil.Process) -> int:
    return proc.num_fds() if hasattr(proc, "num_fds") else proc.num_handles()


def shared_batches(pids) -> int:
    """Bytes of PyTorch shared-memory files (batches in flight) held open by these processes, each file once."""
    seen: dict[tuple[int, int], int] = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # not Linux, or the process is gone
            continue
        for fd in fds:
            path = f"/proc/{pid}/fd/{fd}"
            try:
                if "/torch_" not in os.readlink(path):
                    continue
                st = os.stat(path)
            except OSError:  # closed meanwhile
                continue
            seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


def exit_status(pid: int) -> str | None:
    """How a child process ended, without reaping it ("killed by signal 9 (SIGKILL)"); None while it runs."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except (ChildProcessError, AttributeError, OSError):  # already reaped (a normal shutdown), or not POSIX
        return None
    if info is None:
        return None
    if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
        return f"killed by signal {info.si_status} ({signal.Signals(info.si_status).name})"
    return f"exited with code {info.si_status}"


def _read_children(main: psutil.Process, read):
    """`(child, read(child))` for each live child process, all generations; one that exits meanwhile is skipped."""
    for child in main.children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                yield child, read(child)
        except (psutil.NoSuchProcess, psutil.AccessDenied):  # exited between the listing and the reading
            continue


{% if cookiecutter.with_doctor == "yes" %}
def pss_mib() -> float:
    """PSS of this process and its live children, in MiB: the light reading polled for a peak."""
    main = psutil.Process()
    children = sum(pss for _, (_, pss) in _read_children(main, _memory))
    return (_memory(main)[1] + children) / MiB


{% endif %}
class WorkerDied(RuntimeError):
    """A train loader worker is gone while the run still needs it."""


# PyTorch's two messages for a dead worker: from its SIGCHLD handler ("DataLoader worker (pid 12) is killed by
# signal: Killed.") and from the main loop when a queue read fails ("DataLoader worker (pid(s) 12, 13) exited
# unexpectedly"); which one comes first is a race, and the second has already reaped the worker and lost the signal.
TORCH_WORKER_DEATH = re.compile(
    r"DataLoader worker \(pid(?:\(s\))? ([\d, ]+)\) (is killed by signal|exited unexpectedly)"
)


def _ended(pid: int, chain: str) -> str | None:
    """How a worker ended: from the kernel if it is not reaped yet, else from PyTorch's SIGCHLD line in `chain` (the
    text of the error's chain): its handler raises "DataLoader worker (pid 12) is killed by signal: Killed." inside
    the queue read, which then reaps the worker and raises "exited unexpectedly" from it."""
    status = exit_status(pid)
    said = re.search(rf"DataLoader worker \(pid {pid}\) (?:is killed by signal: ([^.]+)|exited unexpectedly with exit "
                     r"code (\d+))", chain)  # fmt: skip
    if status is not None or said is None:
        return status
    if said[2] is not None:
        return f"exited with code {said[2]}"
    named = [s for s in signal.Signals if signal.strsignal(s) == said[1]]  # "Killed" is SIGKILL's strsignal
    return f"killed by signal {named[0].value} ({named[0].name})" if named else None


def _ended_child(wait_s: float = 2.0) -> str | None:
    """The line for a child process of this one that has ended and is not reaped yet ("DataLoader worker (pid N)
    killed by signal 9 (SIGKILL)"), waiting up to `wait_s` for one still on its way out; None if none has.

    A worker killed while the main process takes the shared memory of its batch (the file descriptor is passed over
    a socket, multiprocessing.resource_sharer) makes that read fail with ConnectionResetError or EOFError. PyTorch
    then asks each worker whether it is alive, a worker still on its way out says yes, and the bare connection error
    comes out instead of PyTorch's own line (the tracebacks of pytorch/pytorch#1551 and #28950)."""
    deadline = time.monotonic() + wait_s
    while True:
        for child in psutil.Process().children():
            status = exit_status(child.pid)
            if status is not None:
                return f"DataLoader worker (pid {child.pid}) {status}"
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def worker_death(exc: BaseException) -> str | None:
    """One line for a dead DataLoader worker behind `exc` (PyTorch's message or ours), else None.

    The traceback of such an error shows only where the main process noticed, never why the worker
    died, so a line naming the worker, its signal or exit code, and the usual cause is all there is to say.
    """
    chain = "\n".join(str(link) for link in causes(exc))
    for link in causes(exc):
        text = str(link).strip().splitlines()[0] if str(link).strip() else ""
        found = TORCH_WORKER_DEATH.match(text) if isinstance(link, RuntimeError) else None
        if isinstance(link, (ConnectionError, EOFError)):  # the worker died while handing over a batch's memory
            text = _ended_child()
            if text is None:
                continue
        if isinstance(link, (WorkerDied, ConnectionError, EOFError)) or found:
            if found:
                pids = [int(p) for p in found.group(1).split(",")]
                ends = [(pid, _ended(pid, chain)) for pid in pids]
                if all(how for _, how in ends):
                    text = "; ".join(f"DataLoader worker (pid {pid}) {how}" for pid, how in ends)
            if "Bus error" in text or "SIGBUS" in text:  # a shared-memory page that could not be had
                return f"{text.split('. ')[0].rstrip('. ')}: {shm_full(link)}"
            if "Killed" in text or "SIGKILL" in text:
                return (
                    f"{text.rstrip('. ')}. A SIGKILL is most often the kernel's out-of-memory killer "
                    "(dmesg shows it): "
                    "lower loader.num_workers or loader.prefetch_factor, or set loader.max_prefetch_mib"
                )
            return f"{text.rstrip('. ')}. Rerun with loader.num_workers=0 to see the error in the main process"
    return None


def sample(worker_pids: set[int]) -> dict:
    """One reading of this process and its children.

    `workers_*` and `fds` cover every live child process: the train loader's workers, the persistent
    validation workers and anything a dataset spawned; all of it is memory the run holds.
    `worker_count` counts only the train loader's workers (`worker_pids`, filled from the batches).
    """
    main = psutil.Process()
    main_rss, main_pss = _memory(main)
    fds = _fds(main)
    workers_rss = workers_pss = 0
    live, train_workers = [main.pid], 0
    for child, ((rss, pss), child_fds) in _read_children(main, lambda c: (_memory(c), _fds(c))):
        fds += child_fds
        workers_rss, workers_pss = workers_rss + rss, workers_pss + pss
        live.append(child.pid)
        train_workers += child.pid in worker_pids
    return {
        "worker_count": train_workers,
        "rss_mib": (main_rss + workers_rss) / MiB,
        "pss_mib": (main_pss + workers_pss) / MiB,
        "main_rss_mib": main_rss / MiB,
        "main_pss_mib": main_pss / MiB,
        "workers_rss_mib": workers_rss / MiB,
        "workers_pss_mib": workers_pss / MiB,
        "fds": fds,
        "shm_mib": shared_batches(live) / MiB,
    }


class Reading(threading.Thread):
    """One `sample()` taken off the training loop: reading smaps_rollup makes the kernel walk each process's
    page tables (~10 ms for a process holding PyTorch), and the loop need not stand still for that."""

    def __init__(self, worker_pids: set[int]):
        super().__init__(name="health-sample", daemon=True)
        self.worker_pids, self.result, self.error = set(worker_pids), None, None
        self.start()

    def run(self) -> None:
        try:
            self.result = sample(self.worker_pids)
        except Exception as e:  # handed to the main thread by get()
            self.error = e

    def get(self) -> dict:
        self.join()
        if self.error is not None:
            raise self.error
        return self.result


class Monitor:
    """Samples health every `every_steps` steps and at the last batch of each epoch (while the epoch's
    workers still live); writes TensorBoard scalars under `health/` and hands the epoch figures to
    metrics.jsonl. Readings run in a short-lived thread and are written once done (at the latest at
    the epoch's end). `runlog.enabled` is False on ranks other than 0: those sample but write nothing."""

    def __init__(self, loader, runlog, every_steps: int):
        self.loader, self.runlog, self.every = loader, runlog, every_steps
        self.plan = None  # memory.Plan, set from the first batch
        self._epoch = None  # the epoch the window belongs to
        self._mark = (0, 0.0, 0.0)  # (step, cumulative data wait, time) at the window's start
        self._pending: list[tuple[int, dict, Reading, str]] = []  # (step, window figures, reading, what for)
        self._epoch_sample: dict | None = None
        self._steps_seen = 0
        self._measured_logged = False

    def set_plan(self, plan) -> None:
        self.plan = plan
        if self.runlog.enabled:
            log.info(plan.line())

    def step(self, step: int, data_wait: float, started: float) -> None:
        """Call once per step with the epoch's cumulative data wait and its start time (perf_counter)."""
        if self._epoch != self.loader.epoch:  # first step of an epoch: the window starts at the epoch start
            self._epoch, self._mark, self._epoch_sample = self.loader.epoch, (step - 1, 0.0, started), None
        self._steps_seen += 1
        self._write_done()
        last = self.loader.at_epoch_end
        if self._measure_now():
            self._measured_logged = True
            self._pending.append((step, {}, Reading(self.loader.worker_pids), "measured"))
        if not (last or (self.every and step % self.every == 0)):
            return
        now = time.perf_counter()
        self._check_workers()
        steps, wait, elapsed = step - self._mark[0], data_wait - self._mark[1], now - self._mark[2]
        self._mark = (step, data_wait, now)
        window = {
            "wait_ms_per_step": 1000 * wait / steps,
            "compute_ms_per_step": 1000 * (elapsed - wait) / steps,
            "data_wait_share": wait / elapsed if elapsed > 0 else 0.0,
        }
        self._pending.append((step, window, Reading(self.loader.worker_pids), "epoch end" if last else "sample"))
        if last and not self.loader.settings.persistent_workers:
            self._write_done(wait=True)  # these workers exit as soon as the loop asks for the next batch: read them now

    def _write_done(self, wait: bool = False) -> None:
        """Write the readings that have finished (all of them, waiting, with `wait`)."""
        still = []
        for step, window, reading, what in self._pending:
            if reading.is_alive() and not wait:
                still.append((step, window, reading, what))
                continue
            figures = {**reading.get(), **window}
            if what == "epoch end":
                self._epoch_sample = figures
            if not self.runlog.enabled:
                continue
            if what == "measured":
                log.info(
                    "prefetch plan %.1f MiB; measured at step %d: %.1f MiB of batches in shared memory (those "
                    "in flight and the one in training), PSS main %.0f MiB + workers %.0f MiB = %.0f MiB "
                    "(RSS %.0f MiB)",
                    self.plan.mib,
                    step,
                    figures["shm_mib"],
                    figures["main_pss_mib"],
                    figures["workers_pss_mib"],
                    figures["pss_mib"],
                    figures["rss_mib"],
                )
            else:
                self.runlog.scalars("health", figures, step)
        self._pending = still

    def _measure_now(self) -> bool:
        """Once, after warm-up: the queue has turned over twice and a full queue's worth of the epoch is left."""
        if self.plan is None or self._measured_logged or not self.runlog.enabled:
            return False
{% if cookiecutter.with_streams == "yes" %}
        known = self.loader.batches_per_epoch  # None: a stream without sizes
        left = self.plan.in_flight if known is None else known - self.loader.position
{% else %}
        left = self.loader.batches_per_epoch - self.loader.position
{% endif %}
        return self._steps_seen >= 2 * self.plan.in_flight + 2 and left >= self.plan.in_flight

    def epoch(self, data_wait: float, train_time: float, page_faults_per_batch: float | None = None) -> dict:
        """The epoch's keys for metrics.jsonl: the reading at its last batch, its data wait share, and the main
        process's page faults per batch (None where the OS does not count them)."""
        self._write_done(wait=True)
        reading = self._epoch_sample or sample(self.loader.worker_pids)
        record = {
            "worker_count": reading["worker_count"],
            "rss_mib": round(reading["rss_mib"], 1),
            "pss_mib": round(reading["pss_mib"], 1),
            "fds": reading["fds"],
            "data_wait_share": data_wait / train_time if train_time > 0 else 0.0,
            "bad_samples": self.loader.skipped,  # left out by data.on_bad_sample=skip (listed in bad_samples.txt)
            "dropped_records": self.loader.dropped_records,  # past the epoch's whole (global, lockstep) batches
            "page_faults_per_batch": None if page_faults_per_batch is None else round(page_faults_per_batch, 1),
        }
        if self.runlog.enabled:
            log.info(
                "health: %d workers, PSS %.0f MiB (main %.0f + workers %.0f), RSS %.0f MiB, %d fds, "
                "%.1f MiB batches in shared memory, data wait %.0f%% of the epoch%s",
                record["worker_count"],
                reading["pss_mib"],
                reading["main_pss_mib"],
                reading["workers_pss_mib"],
                reading["rss_mib"],
                record["fds"],
                reading["shm_mib"],
                100 * record["data_wait_share"],
                "" if page_faults_per_batch is None else f", {page_faults_per_batch:.0f} page faults per batch",
            )
        return record

    def _check_workers(self) -> None:
        for pid in sorted(self.loader.worker_pids):
            status = exit_status(pid)
            if status is not None:
                raise WorkerDied(f"DataLoader worker (pid {pid}) {status}")
