"""Preemption: SIGTERM, SIGUSR1, SIGUSR2 and SIGINT ask the loop to stop after the current step and save.

Handlers are installed before the DataLoader forks its workers, so workers inherit a handler that
only sets a flag: a signal sent to the whole process group (Ctrl-C, SLURM) does not kill them
while the main process is still saving. A handler that was there before ours (submitit's, which
requeues a SLURM job on USR2) is called once the checkpoint is written: see `hand_over`.
"""

from __future__ import annotations

import os
import signal
import threading


class StopRequest:
    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)

    def __init__(self):
        self.signum: int | None = None
        self.previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self.previous[signum] = signal.signal(signum, self._handle)

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

    @staticmethod
    def shield_worker(worker_id: int = 0) -> None:
        """worker_init_fn part: a DataLoader worker leaves the stop signals to the main process.

        PyTorch's workers die on a SIGTERM that does not come from their parent, and torchrun (or
        SLURM) signals the whole process group: the main process would then fail on a dead worker
        instead of finishing the step and saving. So a worker ignores USR1/USR2/INT, and takes a
        SIGTERM only from its parent (which is how the parent shuts it down at exit): SIGTERM is
        blocked and a thread waits for it, reading who sent it.
        """
        for signum in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT):
            signal.signal(signum, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        threading.Thread(target=_exit_on_sigterm_from_parent, name="sigterm-from-parent", daemon=True).start()

    def hand_over(self) -> None:
        """After saving: pass the signal to the handler we replaced, if it was a Python one (submitit's requeue)."""
        previous = self.previous.get(self.signum)
        if callable(previous) and previous is not signal.default_int_handler:
            previous(self.signum, None)


def _exit_on_sigterm_from_parent() -> None:
    parent = os.getppid()
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
            os._exit(0)  # exit code 0: the parent asked, so PyTorch does not report a failed worker
