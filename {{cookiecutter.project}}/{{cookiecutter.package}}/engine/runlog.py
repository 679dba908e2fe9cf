"""What a run writes for people to read: `metrics.jsonl` (one line per epoch), `steps.jsonl` (one line
per `log_every_steps` optimizer steps, with the mean loss over them) and TensorBoard event files under `tb/`."""

from __future__ import annotations

import json
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter


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


def drop_records_from(path: Path, step: int) -> None:
    if path.exists():
        lines = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] < step]
        path.write_text("".join(line + "\n" for line in lines))
