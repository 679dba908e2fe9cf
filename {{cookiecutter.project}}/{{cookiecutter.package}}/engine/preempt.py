"""Preemption: SIGTERM, SIGUSR1, SIGUSR2 and SIGINT ask the loop to stop after the current step and save.

Handlers are installed before the DataLoader forks its workers, so workers inherit a handler that only sets a
flag: a signal sent to the whole process group (Ctrl-C, SLURM) does not kill them while the main process saves.
A handler that was there before ours (a job runner's requeue on USR2) is called once the checkpoint is written.

A Python signal handler runs only when the main thread is back in Python, never while it waits inside a
distributed call: with a dead peer that wait never ends, and torchrun's SIGTERM would only be answered by its
SIGKILL 30 s later. So a watcher thread hears signals through `signal.set_wakeup_fd` and ends the process itself
when a SIGTERM meets such a wait (docs/distributed.md): at once while joining (nothing to save yet), after `grace`
seconds in a collective (live peers arrive by then), at once on a second SIGTERM.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading
import time
from contextlib import contextmanager


class StopRequest:
    """The stop signals' handlers for this process (see the module's docstring); `requested` once one came."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)

    def __init__(self):
        self.signum: int | None = None
        self.previous: dict[int, object] = {}  # the handlers ours replaced, while installed
        self.waiting: tuple[float, float] | None = None  # (since, grace) while the main thread waits on peers

    @contextmanager
    def installed(self):
        """Our handlers and the watcher while the block runs, then the handlers and wakeup fd as they were.
        Enter it before workers fork: they inherit a handler that only sets a flag. Outside the main thread:
        nothing."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {signum: signal.signal(signum, self._handle) for signum in self.SIGNALS}
        read, write = os.pipe()
        os.set_blocking(write, False)
        wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(read,), name="sigterm-while-waiting", daemon=True).start()
        self.previous = previous
        try:
            yield self
        finally:
            signal.set_wakeup_fd(wakeup)
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            os.close(write)  # the watcher reads the pipe's end and stops

    def _watch(self, fd: int) -> None:
        """Watcher thread: the signal numbers arrive as bytes on `fd` even while the main thread is stuck in C++."""
        term_at = None
        while True:
            # sleep until a signal comes; poll only once a SIGTERM is pending, to see a wait outlast its grace
            if select.select([fd], [], [], 0.1 if term_at else None)[0]:
                came = os.read(fd, 512)  # the numbers of the signals that came; nothing once the pipe is closed
                if not came:
                    os.close(fd)
                    return
                if signal.SIGTERM in came:
                    if term_at and self.waiting:
                        _exit_now("a second SIGTERM")
                    term_at = term_at or time.monotonic()
            waiting = self.waiting
            if term_at and waiting and time.monotonic() - max(waiting[0], term_at) >= waiting[1]:
                _exit_now(f"SIGTERM while waiting on the other processes for over {waiting[1]:g} s")

    def _handle(self, signum, frame) -> None:
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without saving
        self.signum = signum

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        return 130 if self.signum == signal.SIGINT else 0

    @contextmanager
    def waiting_on_peers(self, grace: float):
        """Around a call that waits on other processes: a SIGTERM during it ends this process after `grace` s
        (while installed: the watcher reads it)."""
        self.waiting = (time.monotonic(), grace)
        try:
            yield
        finally:
            self.waiting = None

    @staticmethod
    def shield_worker(worker_id: int = 0) -> None:
        """worker_init_fn part: a DataLoader worker leaves the stop signals to the main process.

        PyTorch's workers die on a SIGTERM that does not come from their parent, and torchrun (or SLURM) signals the
        whole process group: the main process would then fail on a dead worker instead of saving. So a worker
        ignores USR1/USR2/INT, and takes a SIGTERM only from its parent (how the parent shuts it down at exit):
        SIGTERM is blocked and a thread waits for it, reading who sent it."""
        signal.set_wakeup_fd(-1)  # the parent's watcher pipe, inherited through fork, is not ours to write to
        for signum in StopRequest.SIGNALS[1:]:  # all but SIGTERM
            signal.signal(signum, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        parent = os.getppid()
        threading.Thread(target=_exit_on_sigterm_from, args=(parent,), name="sigterm-from-parent", daemon=True).start()
        # Linux: the kernel kills this worker (SIGKILL) when its parent dies. Else a worker whose parent was killed
        # notices within 5 s (PyTorch's watchdog), but its exit joins the result queue's feeder thread, which waits for
        # ever on a full pipe whose read end the worker itself holds (inherited at fork): an orphan holding its
        # parent's stdout, which a job runner then waits on for ever.
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
            if os.getppid() != parent:  # the parent died before the call: no death signal will come
                os._exit(0)

    @staticmethod
    @contextmanager
    def starting_workers():
        """Around the start of DataLoader workers that `shield_worker` shields: SIGTERM blocked from their fork on.

        PyTorch's worker dies on a SIGTERM not from its parent from the moment it starts, before its worker_init_fn
        shields it: a stop signalled to the process group as workers start would kill one instead of saving. A
        forked worker keeps its parent's signal mask, so the signal waits in the worker until the shield reads it;
        in the main process it is blocked for the fork only, and delivered to the handler right after."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)

    def hand_over(self) -> None:
        """After saving: pass the signal to the handler we replaced, if it was a Python one (a job runner's requeue)."""
        previous = self.previous.get(self.signum)
        if callable(previous) and previous is not signal.default_int_handler:
            previous(self.signum, None)


def _exit_now(why: str) -> None:
    sys.stderr.write(f"rank {os.environ.get('RANK', 0)}: {why}: exiting now\n")
    sys.stderr.flush()
    os._exit(128 + signal.SIGTERM)  # what a SIGTERM left to its default would give


def _exit_on_sigterm_from(parent: int) -> None:
    while signal.sigwaitinfo({signal.SIGTERM}).si_pid != parent:
        pass  # another process's SIGTERM: a worker leaves the stop to the main process
    os._exit(0)  # exit code 0: the parent asked, so PyTorch does not report a failed worker
