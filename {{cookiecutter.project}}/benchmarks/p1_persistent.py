"""P1: how long the loop waits at an epoch start, with persistent workers vs workers rebuilt every epoch.

    python -m benchmarks.p1_persistent

The dataset's first item in each process costs 0.5 s (opening a database, loading an index), as
many real datasets do. Rebuilt workers pay it every epoch; persistent ones once. The ratio
persistent / rebuilt over epochs 2..N (epoch 1 pays the start either way) is the share of that
start-up cost that persistent workers still pay per epoch: near 0 when it is paid once per run.
"""

import os
import time

import torch
from torch.utils.data import Dataset

from {{ cookiecutter.package }}.engine.loader import LoaderSettings, TrainLoader

EPOCHS = 5
START_COST_S = 0.5


class SlowStart(Dataset):
    """Small tensors; the first item a process makes costs START_COST_S."""

    def __init__(self, size: int = 512):
        self.size, self.ready_in = size, None

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        if self.ready_in != os.getpid():
            time.sleep(START_COST_S)
            self.ready_in = os.getpid()
        return torch.full((3, 32, 32), float(index)), index % 4


def epoch_start_waits(persistent: bool) -> list[float]:
    settings = LoaderSettings(
        batch_size=32, num_workers=2, prefetch_factor=2, pin_memory=False, persistent_workers=persistent, timeout=0.0
    )
    loader, waits = TrainLoader(SlowStart(), settings, seed=0), []
    for _ in range(EPOCHS):
        asked, first = time.perf_counter(), None
        for _batch in loader:
            first = first or time.perf_counter() - asked
        waits.append(first)
    return waits


def main() -> None:
    rebuilt, persistent = epoch_start_waits(False), epoch_start_waits(True)
    print(f"P1 epoch-start wait, {EPOCHS} epochs, 2 workers, first item per process costs {START_COST_S} s")
    print(f"{'epoch':>5}  {'rebuilt s':>10}  {'persistent s':>12}")
    for epoch, (r, p) in enumerate(zip(rebuilt, persistent, strict=True), 1):
        print(f"{epoch:>5}  {r:>10.3f}  {p:>12.3f}")
    later_r, later_p = sum(rebuilt[1:]) / (EPOCHS - 1), sum(persistent[1:]) / (EPOCHS - 1)
    ratio = later_p / later_r
    print(f"epochs 2-{EPOCHS} mean: rebuilt {later_r:.3f} s, persistent {later_p:.4f} s")
    print(
        f"ratio persistent / rebuilt = {ratio:.3f}: the share of the per-process start-up cost still waited for "
        "at each later epoch start with persistent workers (1.0: no gain; near 0: paid once per run)"
    )


if __name__ == "__main__":
    main()
