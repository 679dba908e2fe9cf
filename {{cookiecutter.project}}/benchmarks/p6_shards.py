"""P6: the same images as an image folder and as tar shards, through TrainLoader, for each loader profile.

    python benchmarks/p6_shards.py            # packs data/shapes-600-32 into data/shapes-shards-<N> on first use

Per profile (conf/loader/*.yaml, as train.py resolves them, rng_mode=per_sample): samples/s and
files opened per epoch (counted in every process, workers included). Then the shards'
`shuffle_window` (1 shard, 4, all): samples/s, files opened and the shards one batch touches.
Last, the bytes alone: every file read once in one process, without decoding, to isolate
what the opens cost from the decoding and augmentation that dominate the samples/s above.
Each setting runs a warm-up epoch and EPOCHS timed epochs; the settings take turns for ROUNDS
rounds, and the table shows the median round with the spread (min-max) beside it, so a busy
moment on a shared machine shows up as spread instead of deciding the result.

The files here sit in the page cache after the warm-up, so this measures the cost of opens and
small reads on one machine; on NFS or object storage each open is a round trip and the gap widens.
"""

import multiprocessing
import statistics
import time
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

from benchmarks.common import train_transform
from {{ cookiecutter.package }}.data import ImageFiles, make_shapes
from {{ cookiecutter.package }}.engine import memory
from {{ cookiecutter.package }}.engine.loader import TrainLoader, resolve_settings
from {{ cookiecutter.package }}.shards import INDEX, ShardDataset, pack

PROJECT = Path(__file__).resolve().parents[1]
PER_CLASS, IMAGE_SIZE, PER_SHARD = 600, 32, 100  # 2400 training images -> 24 shards
EPOCHS, ROUNDS, WINDOW = 2, 3, 4
PROFILES = ("memory-tight", "balanced", "throughput")


class CountingImageFiles(ImageFiles):
    """ImageFiles that counts its file opens (one per sample) in a counter shared with forked workers."""

    def __init__(self, root, transform, counter):
        super().__init__(root, transform=transform)
        self.counter = counter

    def read(self, index):
        with self.counter.get_lock():
            self.counter.value += 1
        return super().read(index)


class CountingShards(ShardDataset):
    """ShardDataset that counts the shards it opens in a counter shared with forked workers."""

    def __init__(self, root, transform, counter, shuffle_window):
        super().__init__(root, transform=transform, shuffle_window=shuffle_window)
        self.counter = counter

    def _open(self, shard):
        with self.counter.get_lock():
            self.counter.value += 1
        return super()._open(shard)


def prepare() -> tuple[Path, Path]:
    images = PROJECT / f"data/shapes-{PER_CLASS}-{IMAGE_SIZE}"  # the folder `python train.py` draws
    make_shapes(images, per_class=PER_CLASS, image_size=IMAGE_SIZE, data_seed=2026)  # the shapes.yaml defaults
    packed = PROJECT / f"data/shapes-shards-{PER_SHARD}"
    if not (packed / "train" / INDEX).exists():
        pack(images, packed, PER_SHARD)
    return images / "train", packed / "train"


def settings_for(profile: str, dataset):
    cfg = OmegaConf.load(PROJECT / f"conf/loader/{profile}.yaml")
    settings = resolve_settings(cfg, "cpu")
    if cfg.max_prefetch_mib is not None:
        settings, _ = memory.fit(
            settings, memory.sample_batch_bytes(dataset, settings.batch_size), cfg.max_prefetch_mib, cfg.on_budget
        )
    return settings


def run(dataset, counter, settings) -> tuple[float, float]:
    """(samples/s, files opened per epoch) over EPOCHS timed epochs after a warm-up epoch."""
    loader = TrainLoader(dataset, settings, seed=0)
    for _ in loader:
        pass
    opened, samples, began = counter.value, 0, time.perf_counter()
    for _ in range(EPOCHS):
        for x, _y in loader:
            samples += len(x)
    elapsed = time.perf_counter() - began
    return samples / elapsed, (counter.value - opened) / EPOCHS


def shards_per_batch(dataset: ShardDataset, batch_size: int) -> float:
    """Mean distinct shards in one batch of an epoch's order (rank 0 of 1)."""
    order = dataset.epoch_order(0, 0)
    batches = [order[i : i + batch_size] for i in range(0, len(order) - batch_size + 1, batch_size)]
    return statistics.mean(len(set(dataset.shard[b].tolist())) for b in batches)


def read_bytes_s(folder: CountingImageFiles, shards: ShardDataset, rounds: int = 5) -> tuple[float, float]:
    """Seconds to read every sample's bytes once (no decoding), in one process, each in its epoch order: one open,
    read and close per file for the folder; one seek and read in an open shard for the shards. Best of `rounds`."""
    folder_order = np.random.default_rng(0).permutation(len(folder))
    shard_order = shards.epoch_order(0, 0)
    best = [float("inf"), float("inf")]
    for _ in range(rounds):
        began = time.perf_counter()
        for i in folder_order:
            with open(folder.paths[i], "rb") as f:
                f.read()
        best[0] = min(best[0], time.perf_counter() - began)
        began = time.perf_counter()
        for i in shard_order:
            shards.read(int(i))
        best[1] = min(best[1], time.perf_counter() - began)
    return best[0], best[1]


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"


def main() -> None:
    folder, packed = prepare()
    transform = train_transform(IMAGE_SIZE)
    counter = multiprocessing.get_context("fork").Value("q", 0)
    data = {"image folder": CountingImageFiles(folder, transform, counter)}
    for window in (1, WINDOW, 0):
        data[f"shards w={window}"] = CountingShards(packed, transform, counter, window)
    settings = {p: settings_for(p, data["image folder"]) for p in PROFILES}
    cases = [(p, d) for p in PROFILES for d in ("image folder", f"shards w={WINDOW}")]
    cases += [("balanced", f"shards w={w}") for w in (1, 0)]
    rates, opens = {c: [] for c in cases}, {c: [] for c in cases}
    for _ in range(ROUNDS):
        for case in cases:
            rate, opened = run(data[case[1]], counter, settings[case[0]])
            rates[case].append(rate)
            opens[case].append(opened)
    n, shards = len(data["image folder"]), len(data[f"shards w={WINDOW}"].paths)
    print(
        f"P6 image folder vs tar shards: {n} shapes images ({IMAGE_SIZE}px PNG), {shards} shards of {PER_SHARD}; "
        f"rng_mode=per_sample; median of {ROUNDS} rounds x {EPOCHS} epochs (min-max)"
    )
    print(
        f"{'profile':<13} {'workers':>7} {'image folder samples/s':>24} {'shards samples/s':>20} {'ratio':>6} "
        f"{'files opened/epoch: folder':>27} {'shards':>7}"
    )
    for p in PROFILES:
        s = settings[p]
        folder_case, shard_case = (p, "image folder"), (p, f"shards w={WINDOW}")
        ratio = statistics.median(rates[shard_case]) / statistics.median(rates[folder_case])
        print(
            f"{p:<13} {s.num_workers:>7} {spread(rates[folder_case]):>24} {spread(rates[shard_case]):>20} "
            f"{ratio:>6.2f} "
            f"{statistics.median(opens[folder_case]):>27.0f} {statistics.median(opens[shard_case]):>7.0f}"
        )
    folder_s, shards_s = read_bytes_s(data["image folder"], data[f"shards w={WINDOW}"])
    print(
        f"\nreading the bytes of all {n} images once, one process, no decoding (best of 5): image folder "
        f"{folder_s * 1e3:.0f} ms ({folder_s / n * 1e6:.1f} us per file), shards {shards_s * 1e3:.0f} ms "
        f"({shards_s / n * 1e6:.1f} us per sample): {folder_s / shards_s:.1f}x"
    )
    batch = settings["balanced"].batch_size
    print(f"\nshuffle window (loader=balanced, batch {batch}): shards read together per epoch")
    print(f"{'shuffle_window':<15} {'samples/s':>20} {'files opened/epoch':>19} {'shards per batch':>17}")
    for w in (1, WINDOW, 0):
        case = ("balanced", f"shards w={w}")
        label = f"{w}" if w else f"0 (all {shards})"
        print(
            f"{label:<15} {spread(rates[case]):>20} {statistics.median(opens[case]):>19.0f} "
            f"{shards_per_batch(data[case[1]], batch):>17.1f}"
        )


if __name__ == "__main__":
    main()
