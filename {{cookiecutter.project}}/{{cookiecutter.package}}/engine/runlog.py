"""What a run writes for people to read: `metrics.jsonl` (one line per epoch), `steps.jsonl` (one line
per `log_every_steps` optimizer steps, with the mean loss over them) and TensorBoard event files under `tb/`."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from torch.utils.tensorboard import SummaryWriter

from .device import batch_size, sum_and_read


class RunLog:
    """Only one process writes (rank 0 under torchrun); for the others `enabled=False` makes every call a no-op."""

    def __init__(self, run_dir: Path, purge_step: int | None = None, enabled: bool = True):
        self.enabled = enabled
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        if purge_step is not None:  # resuming into a folder a crashed run also wrote: drop lines past the checkpoint
            for name in ("metrics.jsonl", "steps.jsonl"):
                drop_records_from(run_dir / name, purge_step)
        self.metrics = open(run_dir / "metrics.jsonl", "a", buffering=1)
        self.steps = open(run_dir / "steps.jsonl", "a", buffering=1)
        # purge_step drops events a crashed run wrote past the checkpoint, when resuming into the same folder.
        self.tb = SummaryWriter(log_dir=str(run_dir / "tb"), purge_step=purge_step)

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def step(self, step: int, loss: float, lr: float) -> None:
        """One log interval: `loss` is the mean over the steps since the previous line, `lr` the rate after `step`."""
        if not self.enabled:
            return
        self.steps.write(json.dumps({"step": step, "loss": loss, "lr": lr}) + "\n")
        self.tb.add_scalar("train/loss", loss, step)
        self.tb.add_scalar("train/lr", lr, step)

    def epoch(self, record: dict) -> None:
        if not self.enabled:
            return
        self.metrics.write(json.dumps(record) + "\n")
        for key, value in record.items():
            if isinstance(value, (int, float)) and key not in ("epoch", "step"):
                self.tb.add_scalar(f"epoch/{key}", value, record["step"])
        self.tb.flush()

    def scalars(self, group: str, values: dict, step: int) -> None:
        """TensorBoard only, e.g. the loader health samples under `health/`."""
        if not self.enabled:
            return
        for key, value in values.items():
            self.tb.add_scalar(f"{group}/{key}", value, step)

    def close(self) -> None:
        if not self.enabled or self.steps.closed:
            return
        self.tb.close()
        self.metrics.close()
        self.steps.close()


class EpochMeter:
    """One epoch's running figures. The loss sums stay on the device and are read at log points only (a read makes
    the host wait for the device); the wait for data and the sample count are host numbers."""

    def __init__(self, device: torch.device):
        self.device = device
        self.epoch_loss = torch.zeros((), dtype=torch.float64, device=device)  # sum of loss x batch size
        self.window_loss = torch.zeros((), dtype=torch.float64, device=device)  # sum of losses since the last read
        self.window_steps, self.samples, self.data_wait = 0, 0, 0.0
        self.started = time.perf_counter()
        self.train_time: float | None = None  # the epoch's training seconds, set by end_training()

    def timed(self, batches):
        """`batches`, adding the time the loop stood still waiting for each one to `data_wait`."""
        waiting_since = self.started
        for batch in batches:
            self.data_wait += time.perf_counter() - waiting_since
            yield batch
            waiting_since = time.perf_counter()

    def add(self, loss: torch.Tensor, batch) -> None:
        n = batch_size(batch)
        loss = loss.double()
        self.window_loss += loss
        self.epoch_loss += loss * n
        self.window_steps, self.samples = self.window_steps + 1, self.samples + n

    def read_window(self, stop_requested: bool, world) -> tuple[float, bool]:
        """(the mean loss since the last read, over ranks; whether any rank was asked to stop): one host read."""
        window_sum, signalled = sum_and_read([self.window_loss, stop_requested], self.device, world)
        mean = window_sum / world.world_size / max(self.window_steps, 1)
        self.window_loss.zero_()
        self.window_steps = 0
        return mean, signalled > 0

    def end_training(self) -> float:
        """Stop the epoch's clock (before validation) and return its training seconds."""
        self.train_time = time.perf_counter() - self.started
        return self.train_time

    def read_epoch(self, stop_requested: bool, world) -> tuple[float, float, bool]:
        """(train_loss over the epoch, samples/s, whether any rank was asked to stop): one host read."""
        seconds = self.train_time if self.train_time is not None else self.end_training()
        loss_sum, samples, rate, signalled = sum_and_read(
            [self.epoch_loss, self.samples, self.samples / seconds, stop_requested], self.device, world
        )
        return loss_sum / max(samples, 1), rate, signalled > 0


def drop_records_from(path: Path, step: int) -> None:
    if path.exists():
        lines = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] < step]
        path.write_text("".join(line + "\n" for line in lines))
