"""One epoch's running figures (`EpochMeter`): the loss, gradient norm and loss parts summed on the device, read over
the ranks only at log points and at the epoch's end; in the same read, the ranks agree on a stop (any rank asked to
stop: all stop at that step) and on the first step with a non-finite loss. A mid-epoch checkpoint keeps the sums
(`state`), so a resumed run logs the figures of the run that never stopped."""

from __future__ import annotations

import time

try:
    import resource
except ImportError:  # Windows
    resource = None

import torch

from .device import sum_and_read
from .errors import UserError


class EpochMeter:
    """One epoch's running figures: sums on the device, read at log points only (a read makes the host wait for the
    device); the data wait and the sample count are host numbers. `carried`: the sums over ranks before a mid-epoch
    checkpoint (`state()`), so a resumed run logs the figures of the run that never stopped."""

    def __init__(self, device: torch.device, carried: dict | None = None):
        self.device = device
        # the sums of loss x batch size over the epoch, of micro-batch losses and of gradient norms (before
        # clipping) since the last read, and the first step with a non-finite loss (float64 holds any step exactly)
        sums = (torch.zeros((), dtype=torch.float64, device=device) for _ in range(4))  # each its own tensor
        self.epoch_loss, self.window_loss, self.window_norm, self.first_bad = sums
        self.window_parts = {}  # sums (device tensors) of a task's loss parts since the last read, by name
        self.window_batches = self.window_norms = self.samples = self.batches = 0
        self.data_wait = 0.0
        self.carried = carried or {"window": NO_WINDOW, "epoch": {"loss": 0.0, "samples": 0}}
        self.started = time.perf_counter()
        self._faults_at_start = minor_page_faults()

    def timed(self, batches):
        """`batches`, adding the time the loop stood still waiting for each one to `data_wait`."""
        waiting_since = self.started
        for batch in batches:
            self.data_wait += time.perf_counter() - waiting_since
            yield batch
            waiting_since = time.perf_counter()

    def add(self, loss: torch.Tensor, grad_norm: torch.Tensor | None, parts: dict, n: int, step: int) -> None:
        """One micro-batch's loss (and, on an optimizer step with clipping on, the norm; the task's loss parts), `n`
        the samples the loader collated into it, `step` the optimizer step it belongs to; all device work, no read."""
        if self.window_parts.keys() != parts.keys() and (self.window_parts or self.batches):
            # every rank packs the same parts in the same order for the one all-reduce of a log point
            raise UserError(
                f"task loss() returned parts {sorted(parts)} at step {step}, {sorted(self.window_parts)} before: "
                "return the same part names on every step"
            )
        for name, part in parts.items():
            self.window_parts[name] = self.window_parts.get(name, 0) + part.double()
        loss = loss.double()
        self.window_loss += loss
        self.epoch_loss += loss * n
        self.first_bad.masked_fill_((self.first_bad == 0) & ~torch.isfinite(loss), step)
        if grad_norm is not None:
            self.window_norm += grad_norm.double()
            self.window_norms += 1
        self.window_batches += 1
        self.samples += n
        self.batches += 1

    def _sums(self, world, *more) -> tuple[dict, dict, list[float]]:
        """(the window's sums and counts over ranks, the epoch's, `more` summed over ranks), with what was carried
        in: one host read. Sums of float32 losses in float64 are exact, so they add up the same in any grouping."""
        names = sorted(self.window_parts)
        loss, norm, epoch_loss, samples, *rest = sum_and_read(
            [
                self.window_loss,
                self.window_norm,
                self.epoch_loss,
                self.samples,
                *map(self.window_parts.get, names),
                *more,
            ],
            self.device,
            world,
        )
        parts, rest = dict(zip(names, rest)), rest[len(names) :]  # the parts, then `more`
        window, epoch = self.carried["window"], self.carried["epoch"]
        window = {
            "loss": window["loss"] + loss,
            "batches": window["batches"] + world.world_size * self.window_batches,
            "norm": window["norm"] + norm,
            "norms": window["norms"] + world.world_size * self.window_norms,
            "parts": {n: window["parts"].get(n, 0.0) + parts.get(n, 0.0) for n in sorted({*window["parts"], *parts})},
        }
        return window, {"loss": epoch["loss"] + epoch_loss, "samples": epoch["samples"] + round(samples)}, rest

    def read_window(self, stop_requested: bool, world, keep: bool = False) -> tuple[dict, int, bool]:
        """({loss, grad_norm when clipping is on, loss_<part>}: means since the last read, over ranks; the first step
        with a non-finite loss (0: none); whether any rank was asked to stop): one host read. `keep`: the window
        goes on (a stop off the log interval: the resumed run's next line covers the same steps)."""
        bad = self.first_bad > 0  # whether this rank diverged: sum_and_read counts it as 1.0
        window, _, (bad_step_sum, bad_ranks, signalled) = self._sums(world, self.first_bad, bad, stop_requested)
        batches = max(window["batches"], 1)
        figures = {"loss": window["loss"] / batches}
        if window["norms"]:
            figures["grad_norm"] = window["norm"] / window["norms"]
        figures.update({f"loss_{name}": total / batches for name, total in window["parts"].items()})
        if not keep:
            self.window_parts = dict.fromkeys(self.window_parts, 0)  # the names stay: the next window brings the same
            self.window_loss.zero_()
            self.window_norm.zero_()
            self.window_batches = self.window_norms = 0
            self.carried = {**self.carried, "window": NO_WINDOW}
        first_bad = round(bad_step_sum / bad_ranks) if bad_ranks else 0  # ranks that diverged, their mean step
        return figures, first_bad, signalled > 0

    def state(self, world) -> dict:
        """The running sums over ranks, for a mid-epoch checkpoint: one host read, a collective."""
        window, epoch, _ = self._sums(world)
        return {"window": window, "epoch": epoch}

    def training_time(self) -> tuple[float, float | None]:
        """The seconds of training since the epoch started and this process's minor page faults per batch (None where
        there is no getrusage), taken before a validation adds its own."""
        faults = minor_page_faults()
        per_batch = (faults - self._faults_at_start) / self.batches if faults is not None and self.batches else None
        return time.perf_counter() - self.started, per_batch

    def read_epoch(self, seconds: float, stop_requested: bool, world) -> tuple[float, float, bool]:
        """(train_loss over the epoch so far, samples/s over its `seconds` of training in this process, whether any
        rank was asked to stop): one host read."""
        _, epoch, (rate, signalled) = self._sums(world, self.samples / seconds, stop_requested)
        return epoch["loss"] / max(epoch["samples"], 1), rate, signalled > 0


NO_WINDOW = {"loss": 0.0, "batches": 0, "norm": 0.0, "norms": 0, "parts": {}}


def minor_page_faults() -> int | None:
    """This process's minor page faults so far, all threads (None where there is no getrusage): a step that
    faults thousands of times is taking back memory its allocator gave away (engine/process.py)."""
    return None if resource is None else resource.getrusage(resource.RUSAGE_SELF).ru_minflt
