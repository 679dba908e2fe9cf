"""Preemption: SIGTERM, SIGUSR1 and SIGINT ask the loop to stop after the current step and save.

Handlers are installed before the DataLoader forks its workers, so workers inherit a handler that
only sets a flag: a signal sent to the whole process group (Ctrl-C, SLURM) does not kill them
while the main process is still saving.
"""

from __future__ import annotations

import signal
import threading


class StopRequest:
    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self):
        self.signum: int | None = None
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                signal.signal(signum, self._handle)

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
