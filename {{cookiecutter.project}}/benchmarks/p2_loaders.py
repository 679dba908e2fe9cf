"""P2: samples/s of TrainLoader (with its resume bookkeeping) vs a plain DataLoader vs torchdata's StatefulDataLoader.

TrainLoader runs in both rng modes: per_worker (worker streams snapshotted with every batch: its
ratio to DataLoader is the cost of exact resume) and per_sample (reseeding the generators the data set draws
from before every sample instead: its ratio to per_worker is the cost of that seeding).

    python -m benchmarks.p2_loaders            # pip install -e ".[bench]" (torchdata) for the StatefulDataLoader column

Same data (the generated shapes, decoded and augmented in the workers), batch 64, 2 workers,
prefetch 2, persistent workers. Each loader runs a warm-up epoch, then EPOCHS timed epochs; the
three take turns for ROUNDS rounds and the best round counts, so a busy moment on the machine
does not decide the result.
"""

import time
import warnings

import numpy as np
import torch
from torch.utils.data import DataLoader

from benchmarks.common import samples_per_s, train_transform
from {{ cookiecutter.package }}.data import shapes
from {{ cookiecutter.package }}.engine import rng
from {{ cookiecutter.package }}.engine.loader import BatchIndices, LoaderSettings, SeededBatches, TrainLoader

try:
    from torchdata.stateful_dataloader import StatefulDataLoader

    STATEFUL_WHY = None
except Exception as e:  # not installed, or built for another torch
    StatefulDataLoader, STATEFUL_WHY = None, f"{type(e).__name__}: {e}"

EPOCHS, ROUNDS, BATCH, WORKERS, PREFETCH = 2, 3, 64, 2, 2


def build(kind: str, dataset):
    if kind.startswith("TrainLoader"):
        settings = LoaderSettings(BATCH, WORKERS, PREFETCH, False, True, 0.0)
        return TrainLoader(dataset, settings, seed=0, rng_mode=kind.split()[1])
    cls = DataLoader if kind == "DataLoader" else StatefulDataLoader
    return cls(
        dataset,
        batch_size=BATCH,
        shuffle=True,
        drop_last=True,
        num_workers=WORKERS,
        prefetch_factor=PREFETCH,
        persistent_workers=True,
        generator=torch.Generator().manual_seed(0),
    )


class PerBatchSeeding(SeededBatches):
    """The keying per_sample had before it keyed each sample: the three generators seeded once per batch from
    (seed, rank, epoch, batch number). Cheaper, but a sample's draws then depend on its batch and rank."""

    def __getitems__(self, batch: BatchIndices):
        key = np.random.SeedSequence([self.seed, 0, batch.epoch, batch.number]).generate_state(2, np.uint32)
        rng.seed_cpu(int(key[0]) << 32 | int(key[1]))
        return self._fetch(batch)


def fetch_cost_of_seeding(dataset, batches: int = 30, rounds: int = 5) -> dict:
    """Seconds per batch to fetch the same batches in this process: unseeded (per_worker), seeded once per batch
    (per_sample's former keying) and seeded per sample (per_sample now: torch alone for these torchvision transforms,
    and all three generators, as for a data set that draws from numpy or python too).

    Worker scheduling moves whole-loader samples/s by several percent between runs on a small
    machine; timing the fetch itself, the three in turns, isolates what the seeding adds."""
    every = SeededBatches(dataset, 0, per_sample=True)
    every.seeding.all = True  # as once a data set is seen drawing from numpy or python
    variants = {
        "unseeded": SeededBatches(dataset, 0, per_sample=False),
        "per batch": PerBatchSeeding(dataset, 0, per_sample=False),
        "per sample": SeededBatches(dataset, 0, per_sample=True),
        "per sample, all three": every,
    }
    keys = [BatchIndices(list(range(i * BATCH, (i + 1) * BATCH)), 0, i) for i in range(batches)]
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(rounds):
        for name, wrapped in variants.items():
            began = time.perf_counter()
            for key in keys:
                wrapped.__getitems__(key)
            best[name] = min(best[name], time.perf_counter() - began)
    return {name: seconds / batches for name, seconds in best.items()}


def main() -> None:
    warnings.filterwarnings("ignore", "'set_vital' is deprecated")  # torchdata 0.11 on a newer torch
    dataset = shapes("data/shapes-600-32", "train", transform=train_transform(32))
    kinds = ["DataLoader", "TrainLoader per_worker", "TrainLoader per_sample"]
    kinds += ["StatefulDataLoader"] if StatefulDataLoader else []
    best = {k: 0.0 for k in kinds}
    for _ in range(ROUNDS):
        for kind in kinds:
            best[kind] = max(best[kind], samples_per_s(build(kind, dataset), EPOCHS))
    print(
        f"P2 loader samples/s, {len(dataset)} shapes images, batch {BATCH}, {WORKERS} workers, prefetch {PREFETCH}, "
        f"persistent; best of {ROUNDS} rounds x {EPOCHS} epochs"
    )
    print(f"{'loader':<24} {'samples/s':>10} {'/ DataLoader':>13}")
    for kind in kinds:
        print(f"{kind:<24} {best[kind]:>10.0f} {best[kind] / best['DataLoader']:>13.3f}")
    ratio = best["TrainLoader per_sample"] / best["TrainLoader per_worker"]
    print(f"rng_mode cost: per_sample / per_worker samples/s = {ratio:.3f} (whole loader; 1.0: seeding costs nothing)")
    cost = fetch_cost_of_seeding(dataset)
    plain = cost["unseeded"]
    for name in ("per batch", "per sample", "per sample, all three"):
        print(
            f"rng_mode cost: batch fetch time seeded {name} / unseeded = {cost[name] / plain:.4f} "
            f"({(cost[name] - plain) * 1e6:+.0f} us per batch of {BATCH}, same batches, in one process)"
        )
    if StatefulDataLoader is None:
        print(f"{'StatefulDataLoader':<24} skipped: torchdata cannot be imported here ({STATEFUL_WHY})")


if __name__ == "__main__":
    main()
