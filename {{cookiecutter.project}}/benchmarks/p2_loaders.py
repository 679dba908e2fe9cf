"""P2: samples/s of our TrainLoader (with its resume bookkeeping) vs a plain DataLoader vs torchdata's StatefulDataLoader.

TrainLoader runs in both rng modes: per_worker (worker streams snapshotted with every batch: the
exact-resume overhead, budget 2% against DataLoader) and per_sample (also reseeding the three
generators before every batch: budget 3% against per_worker).

    python benchmarks/p2_loaders.py            # pip install -e ".[bench]" (torchdata) for the StatefulDataLoader column

Same data (the generated shapes, decoded and augmented in the workers), batch 64, 2 workers,
prefetch 2, persistent workers. Each loader runs a warm-up epoch, then EPOCHS timed epochs; the
three take turns for ROUNDS rounds and the best round counts, so a busy moment on the machine
does not decide the result.
"""

import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from {{ cookiecutter.package }}.data import shapes, train_transform  # noqa: E402
from {{ cookiecutter.package }}.loader import LoaderSettings, TrainLoader  # noqa: E402

try:
    from torchdata.stateful_dataloader import StatefulDataLoader
    STATEFUL_WHY = None
except Exception as e:  # not installed, or built for another torch
    StatefulDataLoader, STATEFUL_WHY = None, f"{type(e).__name__}: {e}"

EPOCHS, ROUNDS, BATCH, WORKERS, PREFETCH = 2, 3, 64, 2, 2


def rate(loader) -> float:
    for _ in loader:  # warm-up epoch: workers start, files enter the page cache
        pass
    samples, began = 0, time.perf_counter()
    for _ in range(EPOCHS):
        for x, _y in loader:
            samples += len(x)
    return samples / (time.perf_counter() - began)


def build(kind: str, dataset):
    if kind.startswith("TrainLoader"):
        settings = LoaderSettings(BATCH, WORKERS, PREFETCH, False, True, 0.0)
        return TrainLoader(dataset, settings, seed=0, rng_mode=kind.split()[1])
    cls = DataLoader if kind == "DataLoader" else StatefulDataLoader
    return cls(dataset, batch_size=BATCH, shuffle=True, drop_last=True, num_workers=WORKERS, prefetch_factor=PREFETCH,
               persistent_workers=True, generator=torch.Generator().manual_seed(0))


def main() -> None:
    warnings.filterwarnings("ignore", "'set_vital' is deprecated")  # torchdata 0.11 on a newer torch
    dataset = shapes("data/shapes", "train", transform=train_transform(32))
    kinds = ["DataLoader", "TrainLoader per_worker", "TrainLoader per_sample"] + (["StatefulDataLoader"] if StatefulDataLoader else [])
    best = {k: 0.0 for k in kinds}
    for _ in range(ROUNDS):
        for kind in kinds:
            best[kind] = max(best[kind], rate(build(kind, dataset)))
    print(f"P2 loader samples/s, {len(dataset)} shapes images, batch {BATCH}, {WORKERS} workers, prefetch {PREFETCH}, "
          f"persistent; best of {ROUNDS} rounds x {EPOCHS} epochs")
    print(f"{'loader':<24} {'samples/s':>10} {'/ DataLoader':>13}")
    for kind in kinds:
        print(f"{kind:<24} {best[kind]:>10.0f} {best[kind] / best['DataLoader']:>13.3f}")
    print(f"rng_mode cost: per_sample / per_worker = {best['TrainLoader per_sample'] / best['TrainLoader per_worker']:.3f}")
    if StatefulDataLoader is None:
        print(f"{'StatefulDataLoader':<24} skipped: torchdata cannot be imported here ({STATEFUL_WHY})")


if __name__ == "__main__":
    main()
