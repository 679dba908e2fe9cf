"""P7: real photos decoded + RandomResizedCrop(224) + flip, per worker process: this project's reader against
torchvision's ImageFolder with PIL, the same v2 transforms.

    python -m benchmarks.p7_photos          # writes data/photos-500x375 and data/photos-2048x1536 on first use
    python -m benchmarks.p7_photos --gpu    # nvJPEG batch decode against libjpeg-turbo on the CPU (CUDA only)
    python -m benchmarks.p7_photos --loader # train.py's loader path, data.decode=gpu against auto (CUDA only)

The photos: scikit-learn's two sample photographs (640 x 427, shipped with the package: `pip install -e
".[bench]"`), cut at random 4:3 windows and re-encoded as JPEG (quality 90) at 500 x 375 and at 2048 x 1536,
FILES per size. Each variant makes every sample once in this one process with one intra-op thread, as a
DataLoader worker does: images/s per worker process. The variants take turns sample by sample, with the same
random boxes and flips, for ROUNDS rounds; the table shows the median round with the spread (min-max) beside
it, so a busy moment on a shared machine shows up as spread instead of deciding the result. The ratio's spread
is that of the per-round ratios.

- `ImageFolder + PIL`: torchvision.datasets.ImageFolder, PIL decodes the whole file, then the transform.
- `ImageFiles decode=pil`: this project's reader doing the same (what data.decode=pil keeps).
- `ImageFiles decode=torchvision`: the crop's box drawn first, the file decoded whole by libjpeg-turbo through
  torchvision.io, the box cut and resized.
- `ImageFiles decode=auto` (the default): the box drawn first, the file decoded at the smallest DCT scale
  (1/2, 1/4, 1/8) that holds the box at 224 pixels or more, else as decode=torchvision.
- `decode_jpeg, whole`: the reference, libjpeg-turbo's full-size decode rate of the same bytes (in memory, no
  crop, no transform).

`--loader` times whole epochs of train.py's loader path on the same photos, each file read LOADER_REPEAT times
an epoch (the page cache holds them): TrainLoader with WORKERS workers, the copy to the GPU (device_batches) and
data.normalize (input_transform), which with data.decode=gpu first decodes the batch's files with nvJPEG and
crops, resizes and flips them there. The same workers, so the ratio is what moving the decode off them buys.

ImageFolder's rate at 2,048 x 1,536 depends on whether glibc maps its 9 MB buffers fresh for each image: run it
also with `MALLOC_MMAP_THRESHOLD_=134217728 MALLOC_TRIM_THRESHOLD_=268435456` set, which keeps them in the heap.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf
from PIL import Image
from sklearn.datasets import load_sample_images
from torchvision.datasets import ImageFolder
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import v2

from {{ cookiecutter.package }}.data import ImageFiles
from {{ cookiecutter.package }}.engine.device import device_batches, input_transform
from {{ cookiecutter.package }}.engine.loader import LoaderSettings, TrainLoader
from {{ cookiecutter.package }}.engine.parts import collate

PROJECT = Path(__file__).resolve().parents[1]
SIZES = ((500, 375), (2048, 1536))
FILES, ROUNDS, CROP = 48, 5, 224
DECODERS = ("pil", "torchvision", "auto")
WORKERS, LOADER_BATCH, LOADER_REPEAT = 4, 64, 16  # --loader: 48 files x 16 = 768 samples, 12 batches an epoch


def photos(width: int, height: int) -> Path:
    """data/photos-<W>x<H>/<photo>/NNN.jpg: FILES cuts of the sample photos, one class folder per photo."""
    root = PROJECT / f"data/photos-{width}x{height}"
    if len(list(root.glob("*/*.jpg"))) == FILES:
        return root
    sample = load_sample_images()
    gen = np.random.default_rng(7)
    for n in range(FILES):
        k = n % len(sample.images)
        pixels, name = sample.images[k], Path(sample.filenames[k]).stem
        h, w = pixels.shape[:2]
        cut_w = int(gen.uniform(0.5, 1.0) * min(w, h * 4 / 3))  # a 4:3 window of half the photo's width or more
        cut_h = cut_w * 3 // 4
        x, y = int(gen.integers(0, w - cut_w + 1)), int(gen.integers(0, h - cut_h + 1))
        image = Image.fromarray(pixels[y : y + cut_h, x : x + cut_w]).resize((width, height), Image.BICUBIC)
        (root / name).mkdir(parents=True, exist_ok=True)
        image.save(root / name / f"{n:03d}.jpg", quality=90)
    return root


def transform() -> v2.Compose:
    """The shipped training list at 224 px, with torchvision's default crop scale (0.08-1) as in ImageNet training."""
    return v2.Compose([v2.ToImage(), v2.RandomResizedCrop(CROP, antialias=True), v2.RandomHorizontalFlip()])


def rate(make, count: int) -> float:
    """Images/s making samples 0 .. count - 1 once each."""
    began = time.perf_counter()
    for i in range(count):
        make(i)
    return count / (time.perf_counter() - began)


def one_round(variants: dict, count: int, round_: int) -> dict[str, float]:
    """Images/s of each variant over samples 0 .. count - 1, the variants taking turns sample by sample (a burst
    of other work on the machine then slows them all alike), torch's generator seeded per sample and round: every
    variant draws the same boxes and flips, so they do the same work (a large box costs ImageFolder's resize far
    more than a small one)."""
    spent = dict.fromkeys(variants, 0.0)
    for i in range(count):
        for name, dataset in variants.items():
            torch.manual_seed(round_ * count + i)
            began = time.perf_counter()
            dataset[i]
            spent[name] += time.perf_counter() - began
    return {name: count / seconds for name, seconds in spent.items()}


class WholeDecode:
    """The reference: libjpeg-turbo (torchvision.io) decoding each file's bytes whole, from memory."""

    def __init__(self, data: list[torch.Tensor]):
        self.data = data

    def __getitem__(self, index: int) -> torch.Tensor:
        return decode_jpeg(self.data[index], mode=ImageReadMode.RGB)


def spread(values) -> str:
    return f"{statistics.median(values):8.1f}  ({min(values):.1f}-{max(values):.1f})"


def cpu(args) -> int:
    torch.set_num_threads(1)  # a DataLoader worker's setting: one intra-op thread per process
    print(f"decode + RandomResizedCrop({CROP}) + flip, images/s in one process (one thread): median of {args.rounds}")
    print("rounds (min-max)\n")
    for width, height in SIZES:
        root = photos(width, height)
        variants = {"ImageFolder + PIL": ImageFolder(str(root), transform=transform())}
        variants |= {f"ImageFiles decode={d}": ImageFiles(root, transform(), decode=d) for d in DECODERS}
        files = [Path(p) for p in variants["ImageFiles decode=pil"].paths]
        data = [torch.frombuffer(bytearray(f.read_bytes()), dtype=torch.uint8) for f in files]
        variants["decode_jpeg, whole"] = WholeDecode(data)
        results = {name: [] for name in variants}
        one_round(variants, len(files), -1)  # warm-up: the files in the page cache, every code path run once
        for round_ in range(args.rounds):
            for name, value in one_round(variants, len(files), round_).items():
                results[name].append(value)
        print(f"{width} x {height}, {len(files)} JPEG files")
        for name, values in results.items():
            print(f"  {name:<28} {spread(values)}")
        ratios = [a / b for a, b in zip(results["ImageFiles decode=auto"], results["ImageFolder + PIL"], strict=True)]
        print(f"  decode=auto / ImageFolder + PIL: {spread(ratios).strip()}x (each round's ratio)\n")
    print("Above 1: the project's reader makes that many times the images per worker; decode_jpeg whole is what")
    print("decoding every pixel costs at best, which the reader undercuts by decoding at a smaller scale.")
    return 0


def on_gpu(batches: list[list[torch.Tensor]]) -> float:
    """Images/s decoding the batches with nvJPEG, one call a batch."""
    began = time.perf_counter()
    for batch in batches:
        decode_jpeg(batch, mode=ImageReadMode.RGB, device="cuda")
    torch.cuda.synchronize()  # the decodes are asynchronous: the time is theirs once the device is done
    return sum(len(b) for b in batches) / (time.perf_counter() - began)


def gpu(args) -> int:
    """nvJPEG (torchvision.io.decode_jpeg on the device, one call a batch of 64) against libjpeg-turbo on one CPU
    thread, images/s: what data.decode=gpu would buy."""
    if not torch.cuda.is_available():
        print("error: --gpu decodes with nvJPEG on a CUDA device and torch sees none", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    for width, height in SIZES:
        files = sorted(photos(width, height).glob("*/*.jpg"))
        data = [torch.frombuffer(bytearray(f.read_bytes()), dtype=torch.uint8) for f in files]
        batches = [data[i : i + 64] for i in range(0, len(data), 64)]
        on_gpu(batches)  # warm-up: nvJPEG's handles and buffers
        gpu_rates, cpu_rates = [], []
        for _ in range(args.rounds):
            gpu_rates.append(on_gpu(batches))
            cpu_rates.append(rate(WholeDecode(data).__getitem__, len(data)))
        ratio = statistics.median(gpu_rates) / statistics.median(cpu_rates)
        print(f"{width} x {height}: gpu-decode {spread(gpu_rates).strip()} images/s on {torch.cuda.get_device_name()}, "
              f"cpu-decode {spread(cpu_rates).strip()} images/s on one thread: {ratio:.1f}x")  # fmt: skip
    return 0


def loader_rates(root: Path, decode: str, workers: int, rounds: int) -> list[float]:
    """Images/s of `rounds` epochs through the loader path train.py runs (after one warm-up epoch: workers start,
    nvJPEG's handles): TrainLoader (persistent workers, pinned), device_batches, then data.normalize."""
    dataset = ImageFiles(root, transform(), decode=decode)
    dataset.paths, dataset.labels = np.tile(dataset.paths, LOADER_REPEAT), np.tile(dataset.labels, LOADER_REPEAT)
    data_cfg = OmegaConf.create({"decode": decode, "normalize": None})  # the keys the collate and input_transform read
    settings = LoaderSettings(LOADER_BATCH, workers, 2, True, True, 0.0)
    loader = TrainLoader(dataset, settings, seed=0, collate_fn=collate(OmegaConf.create({"data": data_cfg}), dataset))
    device = torch.device("cuda")
    prepare = input_transform(data_cfg, device)
    rates = []
    for epoch in range(rounds + 1):
        began, images = time.perf_counter(), 0
        for batch in device_batches(loader, device):
            images += len(prepare(batch)[0])
        torch.cuda.synchronize()  # the decodes and copies are asynchronous: the time is theirs once the GPU is done
        if epoch:
            rates.append(images / (time.perf_counter() - began))
    return rates


def loader(args) -> int:
    """train.py's loader path with data.decode=gpu against data.decode=auto, images/s, the same workers."""
    if not torch.cuda.is_available():
        print("error: --loader times data.decode=gpu, which decodes with nvJPEG on a CUDA device, and torch sees none",
              file=sys.stderr)  # fmt: skip
        return 2
    what = f"{args.workers} workers, batch {LOADER_BATCH}, RandomResizedCrop({CROP}) + flip"
    print(f"loader path, {what}, each of the {FILES} files {LOADER_REPEAT} times an epoch: images/s, median of "
          f"{args.rounds} epochs (min-max)")  # fmt: skip
    for width, height in SIZES:
        root = photos(width, height)
        rates = {d: loader_rates(root, d, args.workers, args.rounds) for d in ("gpu", "auto")}
        ratio = statistics.median(rates["gpu"]) / statistics.median(rates["auto"])
        print(f"{width} x {height}: decode=gpu {spread(rates['gpu']).strip()}, decode=auto "
              f"{spread(rates['auto']).strip()} images/s on {torch.cuda.get_device_name()}: {ratio:.1f}x")  # fmt: skip
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.p7_photos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"rounds each variant runs (default {ROUNDS})")
    parser.add_argument("--gpu", action="store_true", help="nvJPEG batch decode against one CPU thread (CUDA only)")
    parser.add_argument("--loader", action="store_true", help="the loader path, data.decode=gpu vs auto (CUDA only)")
    parser.add_argument("--workers", type=int, default=WORKERS, help=f"--loader's workers (default {WORKERS})")
    args = parser.parse_args(argv)
    if args.loader:
        return loader(args)
    return gpu(args) if args.gpu else cpu(args)


if __name__ == "__main__":
    sys.exit(main())
