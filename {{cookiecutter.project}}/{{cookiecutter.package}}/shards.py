"""Tar shards (the WebDataset layout) with an index, served by TrainLoader like any map-style data set (docs/shards.md).

    python -m {{ cookiecutter.package }}.shards pack data/images data/shards --per-shard 1000
    python train.py data=shards data.root=data/shards data.num_classes=10

A folder of many small files costs an open and a metadata lookup per sample per epoch: a local SSD forgives that, NFS
and object storage do not. `pack` writes each split as tar files, per sample `<key>.<ext>` (the image's bytes as they
were) and `<key>.cls` (the label), so `webdataset` and `tar` read them too, plus `index.json`: per shard its name and
size, per sample where each member's data starts. With the index the shards are a map-style data set, so everything
TrainLoader does for an image folder holds unchanged (exact mid-epoch resume, the same weights for any loader profile
under rng_mode=per_sample, DDP sharding, the prefetch plan, the monitor). Sample `i` lives at (shard, offset, size) in
numpy arrays (one object each: workers do not copy the parent's memory page by page, pytorch/pytorch#13246).
`epoch_order(seed, epoch)` shuffles the shards, then the samples of each window of `shuffle_window` shards together:
a batch touches a few files instead of one per sample; the price (samples of far-apart shards never share a batch
within an epoch) is harmless as `pack` mixes the classes across the shards (`--seed`), costly for shards of few
classes each (`--in-order`, or sorted by another tool).
{% if cookiecutter.with_streams == "yes" %}

`stream.py`'s shard streams are for data read in order, without an index: their resume is exact with the same
readers, and which records share a batch depends on the readers (docs/streams.md).
{% endif %}
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tarfile
from collections import OrderedDict
from pathlib import Path

import numpy as np
{% if cookiecutter.with_photos == "no" %}
from PIL import Image
{% endif %}
from torch.utils.data import Dataset

from .data import ImageFiles
from .engine.data_check import check_classes
{% if cookiecutter.with_photos == "yes" %}
from .engine.decode import CropDecoder
{% endif %}
from .engine.errors import UserError
from .engine.files import durable
from .engine.schema import integer

INDEX = "index.json"
FORMAT = 1  # bump when the layout of the shards or the index changes
SPLITS = ("train", "val")


def pack(src, dst, per_shard: int, report=print, seed: int | None = 0) -> dict[str, int]:
    """Pack `src/train/<class>/*` and `src/val/<class>/*` into `dst/<split>/shard-XXXXX.tar` + `index.json`.

    The samples are mixed across the shards in an order drawn from `seed` (`None`: the sorted file order, each shard
    then holding a class or two), as WebDataset advises. Deterministic: ImageFolder's labels (sorted class folders),
    the order a function of (seed, the sorted file list), fixed tar headers, keys numbered per split in the order
    written. All is checked before a byte is written; `dst` must be new or empty. Returns samples per split.
    """
    src, dst = Path(src), Path(dst)
    for flag, value, low in (("--per-shard", per_shard, 1), ("--seed", 0 if seed is None else seed, 0)):
        if wanted := integer(low)(value):
            raise UserError(f"{flag} must be {wanted}, got {value!r}")
    if not (src / "train").is_dir():
        raise UserError(
            f"{str(src / 'train')!r} is not a folder: pack expects SRC/train/<class>/* (and SRC/val/<class>/*)"
        )
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise UserError(f"{str(dst)!r} is not empty: pack writes into a new or empty folder, and nothing was written")
    folders = {split: ImageFiles(src / split) for split in SPLITS if (src / split).is_dir()}  # listed as training does
    classes, listing = folders["train"].classes, {}
    for split, folder in folders.items():
        unknown = sorted(set(folder.classes) - set(classes))
        if unknown:
            raise UserError(
                f"{str(src / split)!r} has class folders that train/ lacks ({', '.join(unknown[:5])}): "
                "labels would not match"
            )
        labels = [classes.index(folder.classes[label]) for label in folder.labels]  # train's numbering
        samples = list(zip(folder.paths.tolist(), labels))
        if seed is not None:  # each split its own stream, so adding a val/ folder leaves the train shards as they were
            mix = np.random.default_rng(np.random.SeedSequence([seed, SPLITS.index(split)]))
            samples = [samples[i] for i in mix.permutation(len(samples))]
        listing[split] = samples
    for split, samples in listing.items():
        folder = dst / split
        folder.mkdir(parents=True)
        shards = [
            write_shard(folder / f"shard-{n // per_shard:05d}.tar", samples[n : n + per_shard], n, src / split)
            for n in range(0, len(samples), per_shard)
        ]
        # seed: the order the samples were mixed in; null: sorted by class folder and file name
        index = {"format": FORMAT, "classes": classes, "per_shard": per_shard, "seed": seed, "samples": len(samples)}
        with durable(folder / INDEX) as f:  # last: a folder with an index holds every shard it lists
            f.write(json.dumps({**index, "shards": shards}, separators=(",", ":")).encode())
        size = sum(s["bytes"] for s in shards) / 2**20
        report(
            f"{split}: {len(samples)} samples, {len(classes)} classes -> {len(shards)} shards, "
            f"{size:.1f} MiB in {folder}"
        )
    return {split: len(samples) for split, samples in listing.items()}


def write_shard(path: Path, samples: list[tuple[str, int]], first_key: int, base: Path) -> dict:
    """One tar file, written `durable`, and its index entry; TarInfo's defaults fix every header field but name and
    size (mtime 0, uid/gid 0, no user names, mode 644), so the same files give the same bytes."""
    rows = []  # per sample: key, path under base, where the image's data starts, its size, label, where .cls starts
    with durable(path) as f, tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for number, (source, label) in enumerate(samples, first_key):
            source, key, starts = Path(source), f"{number:09d}", []
            data = source.read_bytes()
            for name, member in ((f"{key}{source.suffix.lower()}", data), (f"{key}.cls", str(label).encode())):
                starts.append(tar.offset + tarfile.BLOCKSIZE)  # a USTAR header is one block, the data follows it
                info = tarfile.TarInfo(name)
                info.size = len(member)
                tar.addfile(info, io.BytesIO(member))
            rows.append((key, source.relative_to(base).as_posix(), starts[0], len(data), label, starts[1]))
    columns = dict(zip(("keys", "paths", "offsets", "sizes", "labels", "cls_offsets"), map(list, zip(*rows))))
    return {"name": path.name, "bytes": path.stat().st_size, **columns}


class ShardDataset(Dataset):
    """One split packed by `pack`: `(transform(image), label)` per sample, read from the shards via the index.

    `num_classes`, when given, must match the index's class list. `shuffle_window`: how many shards
    (in the epoch's random shard order) have their samples shuffled together; 0 shuffles everything
    together like an image folder. `max_open`: files one process keeps open (default: enough for two
{% if cookiecutter.with_photos == "yes" %}
    windows, so a batch straddling two windows reads without re-opening). `decode` (data.decode): how
    a JPEG is decoded, only as far as the transform's first crop needs by default (engine/decode.py's `CropDecoder`).
{% else %}
    windows, so a batch straddling two windows reads without re-opening).
{% endif %}
    """

    def __init__(
        self,
        root,
        transform=None,
        num_classes: int | None = None,
        shuffle_window: int = 4,
        max_open: int | None = None,
{% if cookiecutter.with_photos == "yes" %}
        decode: str = "auto",
    ):
        self.root, self.transform = Path(root), transform
        self.reader = CropDecoder(transform, decode)
        self.collate_fn = self.reader.collate_fn  # decode=gpu: a batch's files kept as a list (parts.collate)
{% else %}
    ):
        self.root, self.transform = Path(root), transform
{% endif %}
        index = checked_index(self.root, num_classes, shuffle_window)  # now, not hours into the run
        self.classes, shards = index["classes"], index["shards"]
        self.paths = np.array([str(self.root / s["name"]) for s in shards])
        self.shard_bytes = np.array([s["bytes"] for s in shards], dtype=np.int64)
        counts = [len(s["keys"]) for s in shards]
        self.starts = np.cumsum([0, *counts])  # sample number of each shard's first sample
        self.shard = np.repeat(np.arange(len(shards), dtype=np.int64), counts)
        # int64 whatever numpy's default integer is (int32 on Windows before NumPy 2): offsets past 2 GiB
        columns = [[v for s in shards for v in s[k]] for k in ("offsets", "sizes", "labels")]
        self.offset, self.size, self.label = np.array(columns, dtype=np.int64)  # the per-sample lists go on return
        self.key = np.array([k for s in shards for k in s["keys"]])  # member names, for a bad sample's line
        self.shuffle_window = shuffle_window
        window = shuffle_window or len(self.paths)
        self.max_open = max_open or max(1, min(len(self.paths), 2 * window + 2, 256))
        self.opens = 0  # files this process opened: a test and benchmark figure
        self._files: dict[int, OrderedDict] = {}  # per process id: a forked worker never uses its parent's handles
        self._ready: dict[int, bytes] = {}  # bytes `prefetch` read for the samples about to be made

    @staticmethod
    def precheck(root, num_classes: int | None = None, shuffle_window: int = 4, **_) -> list[str]:
        """The split's classes, or the UserError the constructor would raise (no index, a wrong data.num_classes or
        shuffle_window, a missing or truncated shard), before Hydra writes a run folder."""
        return checked_index(Path(root), num_classes, shuffle_window)["classes"]

    def __len__(self) -> int:
        return len(self.offset)

    def __getitem__(self, index: int):
        data = self._ready.pop(index, None) or self.read(index)  # `prefetch`'s bytes, else read now
{% if cookiecutter.with_photos == "yes" %}
        return self.reader(data), int(self.label[index])  # decoded as an image folder's file is (CropDecoder)
{% else %}
        with Image.open(io.BytesIO(data)) as image:
            image = image.convert("RGB")  # as torchvision's ImageFolder loads a file
        return image if self.transform is None else self.transform(image), int(self.label[index])
{% endif %}

    def prefetch(self, indices) -> None:
        """Read a batch's bytes now, in file order (shard, then offset), for the `__getitem__` calls that follow: the
        loader's rng_mode=per_sample makes samples one by one, and still reads each shard in one sweep."""
        in_file_order = sorted(map(int, indices), key=lambda i: (self.shard[i], self.offset[i]))
        self._ready = {i: self.read(i) for i in in_file_order}

    def __getitems__(self, indices):
        """A batch: bytes read in file order, decoded and transformed in the batch's order, so the random draws
        meet the samples exactly as with `__getitem__` one by one."""
        self.prefetch(indices)
        return [self[int(i)] for i in indices]

    def sample_source(self, index: int) -> str:
        """Where sample `index` comes from, for the line that names a bad sample (engine/failures.py)."""
        return f"shard {self.paths[self.shard[index]]}, member {self.key[index]}"

    def read(self, index: int) -> bytes:
        """The image file's bytes as packed: one seek and one read in a shard this process keeps open."""
        shard, size = int(self.shard[index]), int(self.size[index])
        f = self._file(shard)
        f.seek(int(self.offset[index]))
        data = f.read(size)
        if len(data) != size:
            raise UserError(
                f"shard {self.paths[shard]} ended early (sample {index}): it changed after the run "
                "started; copy it again or pack again"
            )
        return data

    def epoch_order(self, seed: int, epoch: int) -> np.ndarray:
        """This epoch's order of all samples, from (seed, epoch) alone: shards shuffled, then samples within windows."""
        gen = np.random.default_rng(np.random.SeedSequence([seed, epoch]))
        shards = gen.permutation(len(self.paths))
        window = self.shuffle_window or len(shards)
        parts = []
        for first in range(0, len(shards), window):
            group = shards[first : first + window]
            members = np.concatenate([np.arange(self.starts[s], self.starts[s + 1]) for s in group])
            parts.append(gen.permutation(members))
        return np.concatenate(parts)

    def _file(self, shard: int):
        files = self._files.setdefault(os.getpid(), OrderedDict())  # this process's (a forked worker starts empty)
        if shard in files:
            files.move_to_end(shard)
            return files[shard]
        check_size(self.paths[shard], int(self.shard_bytes[shard]))  # missing or changed since the run started
        self.opens += 1
        files[shard] = open(self.paths[shard], "rb")
        if len(files) > self.max_open:  # the least recently used goes
            files.popitem(last=False)[1].close()
        return files[shard]

    def __getstate__(self) -> dict:
        """Copies (pickling for spawned workers, copy.copy) start without open files."""
        return {**self.__dict__, "_files": {}}


def check_size(path, expected: int) -> None:
    """A UserError naming the shard when it is missing, or when its size is not the index's."""
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        raise UserError(
            f"shard {path} is missing (listed in {Path(path).parent / INDEX}): restore it or pack again"
        ) from None
    if size != expected:
        what = "truncated" if size < expected else "changed"
        raise UserError(f"shard {path} is {what}: {size} bytes, the index says {expected}; copy it again or pack again")


def checked_index(root: Path, num_classes: int | None, shuffle_window) -> dict:
    """The split's index, once this version reads it, the arguments fit it and each shard it lists is whole."""
    path = root / INDEX
    if not path.is_file():  # no such folder, not one pack wrote, or a pack that did not finish
        raise UserError(
            f"{str(path)!r} is missing: data.root must be a folder written by python -m {__package__}.shards pack "
            "SRC DST (an interrupted pack writes no index: pack again)"
        )
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{str(path)!r} cannot be read ({e}): pack again into an empty folder") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise UserError(
            f"{str(path)!r} is not an index this version reads (format {FORMAT}): pack again into an empty folder"
        )
    check_classes({root.name: index["classes"]}, num_classes)  # as preflight checks the classes precheck returns
    if wanted := integer(0)(shuffle_window):
        raise UserError(f"data.shuffle_window must be {wanted} (shards; 0 = all), got {shuffle_window!r}")
    for shard in index["shards"]:
        check_size(root / shard["name"], int(shard["bytes"]))
    return index


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__package__}.shards", description=__doc__.split("\n\n")[0])
    p = parser.add_subparsers(dest="command", required=True).add_parser(
        "pack", help="pack SRC/train/<class>/* and SRC/val/<class>/* into tar shards + index.json in DST"
    )
    p.add_argument("src", help="image folder holding train/ and val/, one subfolder per class in each")
    p.add_argument("dst", help="new or empty folder for the shards")
    p.add_argument("--per-shard", type=int, default=1000, help="samples per tar file (default 1000): a few hundred MB")
    p.add_argument("--seed", type=int, default=0, help="mix the samples across the shards by this seed (default 0)")
    p.add_argument(
        "--in-order",
        action="store_true",
        help="keep the sorted file order instead (each shard then holds one class or two: a shuffle_window smaller "
        "than the number of shards trains on batches of a few classes)",
    )
    args = parser.parse_args(argv)
    try:
        pack(args.src, args.dst, args.per_shard, seed=None if args.in_order else args.seed)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
