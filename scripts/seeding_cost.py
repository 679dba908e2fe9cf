"""What rng_mode=per_sample's seeding costs on real images: the batch fetch of the generated project's loader
(SeededBatches) seeded before every sample, against the same fetch unseeded, batch by batch in turns, inside a
DataLoader worker (one torch thread), where training fetches.

    .venv/bin/python scripts/seeding_cost.py [--rounds 11]

Data sets, each through the project's ImageFiles and its shapes training transform (RandomResizedCrop + flip):
- shapes: the default generated data, 32x32 PNG;
- digits: scikit-learn's handwritten digits (1,797 real 8x8 scans), as PNG files, cropped to 32;
- photos: scikit-learn's two sample photographs, cut into 500x375 JPEG files (shifted and mirrored crops), cropped
  to 224 as an ImageNet pipeline does.
Per round and data set, the ratio of the seeded to the unseeded fetch time of the same batches, for the project's
seeding (torch alone for these torchvision transforms) and for all three generators seeded, as once a data set is
seen drawing from numpy or python; printed: the median ratio over the rounds, with the lowest and highest. The
time is the worker thread's CPU time (time.thread_time), so that the moments another process holds the core count
for no variant, and the three fetch each batch one right after the other, which goes first taking turns. Each round seeds with another seed: one seed alone gives every round the
same crops, one draw of their cost, while the unseeded fetch draws new ones each round.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from sklearn.datasets import load_digits, load_sample_images

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baked_project import bake  # noqa: E402

BATCH = 32


def digits_folder(root: Path) -> Path:
    for n, (image, label) in enumerate(zip(load_digits().images, load_digits().target)):
        folder = root / "train" / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray((image * 255 / 16).round().astype(np.uint8), "L").save(folder / f"{n:04d}.png")
    return root / "train"


def photo_folder(root: Path, per_photo: int = 48) -> Path:
    rng = np.random.default_rng(0)
    for p, photo in enumerate(load_sample_images().images):  # 427 x 640 RGB each
        folder = root / "train" / f"photo{p}"
        folder.mkdir(parents=True, exist_ok=True)
        height, width = photo.shape[:2]
        for n in range(per_photo):
            top, left = (
                rng.integers(0, height - 375 + 1),
                rng.integers(0, width - 500 + 1),
            )
            crop = photo[top : top + 375, left : left + 500]
            Image.fromarray(crop[:, ::-1] if n % 2 else crop).save(folder / f"{n:03d}.jpg", quality=90)
    return root / "train"


class InTurns(torch.utils.data.Dataset):
    """In the DataLoader worker that receives a batch's key: the batch fetched by each variant in turn (which goes
    first turning each batch), and the worker thread's CPU time each took."""

    def __init__(self, variants):
        self.variants = variants

    def __len__(self) -> int:
        return 1

    def __getitems__(self, key) -> list[float]:
        times = [0.0] * len(self.variants)
        first = key.number % len(self.variants)
        for v in [*range(first, len(self.variants)), *range(first)]:
            began = time.thread_time()
            self.variants[v].__getitems__(key)
            times[v] = time.thread_time() - began
        return times


def round_seconds(variants, keys) -> list[float]:
    """Each variant's fetch time of all `keys`, in one fresh DataLoader worker. Its first batch is fetched once more
    beforehand and not counted: what a process's first fetch pays (lazy imports, its heap's first pages) would
    otherwise fall on the variant that goes first."""
    loader = torch.utils.data.DataLoader(
        InTurns(variants), batch_sampler=keys[:1] + keys, num_workers=1, collate_fn=list
    )
    return [sum(column) for column in zip(*list(loader)[1:])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        project = bake(tmp / "bake")
        sys.path.insert(0, str(project))
        package = next(p.parent.parent.name for p in project.glob("*/engine/run.py"))
        data = __import__(f"{package}.data", fromlist=["ImageFiles"])
        common = __import__("benchmarks.common", fromlist=["train_transform"])
        loader = __import__(f"{package}.engine.loader", fromlist=["BatchIndices", "SeededBatches"])
        sets = {
            "shapes 32x32 PNG, crop 32": (project / "data/shapes-600-32/train", 32),
            "digits 8x8 PNG scans, crop 32": (digits_folder(tmp / "digits"), 32),
            "photos 500x375 JPEG, crop 224": (photo_folder(tmp / "photos"), 224),
        }
        print(f"per_sample seeding cost: batch fetch time seeded / unseeded, batches of {BATCH}, {args.rounds} rounds")
        for name_of_set, (folder, size) in sets.items():
            dataset = data.ImageFiles(folder, transform=common.train_transform(size))
            batches = max(2, min(12, len(dataset) // BATCH))
            order = np.random.default_rng(1).permutation(len(dataset))
            keys = [loader.BatchIndices(order[i * BATCH : (i + 1) * BATCH].tolist(), 0, i) for i in range(batches)]
            plain = loader.SeededBatches(dataset, 0, per_sample=False)
            ratios, per_batch = (
                {"seeded": [], "all three": []},
                {"seeded": [], "all three": []},
            )
            for seed in range(args.rounds + 1):  # round 0 warms the files and code
                # other seeds, other crops: one variant must not find the crop the other just decoded in the caches
                seeded, every = (loader.SeededBatches(dataset, s, per_sample=True) for s in (seed, 1000 + seed))
                every.seeding.all = True
                a, *times = round_seconds([plain, seeded, every], keys)
                for name, b in zip(ratios, times):
                    if seed:
                        ratios[name].append(b / a)
                        per_batch[name].append((b - a) / batches * 1e6)
            print(f"  {name_of_set} (unseeded fetch {a / batches * 1e3:.1f} ms per batch)")
            for name, values in ratios.items():
                print(
                    f"    {name:<10} {statistics.median(values):.4f} (lowest {min(values):.4f}, highest "
                    f"{max(values):.4f}); {statistics.median(per_batch[name]):+.0f} us per batch"
                )


if __name__ == "__main__":
    main()
