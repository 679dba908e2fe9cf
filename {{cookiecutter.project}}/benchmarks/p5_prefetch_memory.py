"""P5: the prefetch plan (memory.py) against the memory the queued batches really take.

    python -m benchmarks.p5_prefetch_memory

Batches of 32 x 3x224x224 images through TrainLoader with persistent workers, as float32 (18.4 MiB)
and as uint8 (4.6 MiB: what the built-in image data ships, normalized on the device by train.py). Once
epoch 1 is over (queue empty, nothing held) the memory is read; then epoch 2 starts, the loop takes
its first batch and stops until the workers have filled every prefetch slot, and it is read again.
The difference is the memory the queue holds, measured two ways:

- held: the PyTorch shared-memory files that the main process and the workers hold open
  (monitor.shared_batches), the same reading train.py logs beside its plan;
- system: the machine's Shmem (/proc/meminfo) plus the private memory (Pss_Anon + Pss_File from
  smaps_rollup) of main + workers. Queued batches sit in shared-memory files that no process has
  mapped yet, so PSS alone misses them. Needs an otherwise quiet machine.

The batch the loop holds (the loader's generator keeps a reference) is taken off both. The last row
is the default config's data (64 x 3x32x32 uint8, 0.19 MiB batches), measured the first way only: too
small for the second. A ratio of 1 means the plan (and so `loader.max_prefetch_mib`) counts exactly the
bytes the queue holds; the plan line names the dtype, so a float32 batch shows as 4x the uint8 one.
"""

import gc
import os
import time
import warnings

import psutil
import torch
from torch.utils.data import Dataset

from benchmarks.common import train_transform
from {{ cookiecutter.package }}.data import shapes
from {{ cookiecutter.package }}.engine import memory, monitor
from {{ cookiecutter.package }}.engine.loader import LoaderSettings, TrainLoader

MiB = 2**20


class Big(Dataset):
    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def __len__(self) -> int:
        return 32 * 24

    def __getitem__(self, index: int):
        return torch.full((3, 224, 224), index % 256, dtype=self.dtype), index % 4


def system_mib() -> float:
    shmem = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("Shmem:")) * 1024
    private = 0
    main = psutil.Process()
    for proc in [main] + main.children(recursive=True):
        for line in open(f"/proc/{proc.pid}/smaps_rollup"):
            key, *value = line.split()
            if key in ("Pss_Anon:", "Pss_File:"):
                private += int(value[0]) * 1024
    return (shmem + private) / MiB


def held_mib() -> float:
    main = psutil.Process()
    return monitor.shared_batches([main.pid] + [c.pid for c in main.children(recursive=True)]) / MiB


def settle(plan_bytes: int, timeout_s: float = 20.0) -> None:
    """Wait until the workers have filled every prefetch slot (plus the batch in hand)."""
    deadline = time.time() + timeout_s
    while held_mib() * MiB < plan_bytes and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)


def measure(dataset, batch_size: int, workers: int, prefetch: int, system: bool) -> tuple[float, float, float | None]:
    settings = LoaderSettings(batch_size, workers, prefetch, False, True, 0.0)
    loader = TrainLoader(dataset, settings, seed=0)
    for batch in loader:  # noqa: B007 (the last batch is measured below); epoch 1: workers reach steady memory
        pass
    plan = memory.plan(batch, settings)
    del batch
    gc.collect()
    time.sleep(0.5)
    empty_held, empty_system = held_mib(), system_mib() if system else None
    batches = iter(loader)
    next(batches)  # epoch 2's first batch: the generator keeps it, the workers refill the queue
    settle(plan.bytes + plan.batch_bytes)
    one = plan.batch_bytes / MiB
    held = held_mib() - empty_held - one
    total = system_mib() - empty_system - one if system else None
    for _ in batches:
        pass
    del loader, batches
    gc.collect()
    while psutil.Process().children():
        time.sleep(0.05)
    return plan.mib, held, total


def main() -> None:
    warnings.filterwarnings("ignore", "This DataLoader will create")  # 4 workers on 2 CPUs: the point of a row
    rows = [
        ("big", torch.float32, 2, 2),
        ("big", torch.uint8, 2, 2),
        ("big", torch.float32, 4, 2),
        ("big", torch.uint8, 4, 2),
    ]
    print(f"P5 prefetch memory: predicted (plan) vs measured, persistent workers, pid {os.getpid()}")
    print(
        f"{'data':<8} {'dtype':<8} {'workers':>7} {'prefetch':>8} {'plan MiB':>9} {'held MiB':>9} "
        f"{'plan/held':>9} {'system MiB':>10} {'plan/system':>11}"
    )
    ratios = []
    for name, dtype, workers, prefetch in rows + [("shapes", torch.uint8, 2, 2)]:
        dataset = Big(dtype) if name == "big" else shapes("data/shapes-600-32", "train", transform=train_transform(32))
        plan, held, total = measure(dataset, 32 if name == "big" else 64, workers, prefetch, system=name == "big")
        ratios.append(plan / held)
        system = f"{total:>10.1f} {plan / total:>11.3f}" if total is not None else f"{'-':>10} {'-':>11}"
        kind = str(dtype).removeprefix("torch.")
        print(f"{name:<8} {kind:<8} {workers:>7} {prefetch:>8} {plan:>9.1f} {held:>9.1f} {plan / held:>9.3f} {system}")
    print(f"plan / held from {min(ratios):.3f} to {max(ratios):.3f} (1 = the plan counts exactly the bytes queued)")


if __name__ == "__main__":
    main()
