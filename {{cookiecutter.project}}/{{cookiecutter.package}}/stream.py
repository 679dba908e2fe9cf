"""Streams: data read in order, shard by shard, that train.py trains on like an indexed data set (docs/streams.md).

A *shard stream* has `shards` (picklable descriptors: paths, URLs), `read(shard)` (that shard's records, transforms
applied) and, best, `sizes` (records per shard): train.py hands whole shards to the readers, seeds each record from
(seed, epoch, shard, record) and resumes from the records consumed (engine/stream_loader.py); `sizes` keeps torchrun
processes in step. `ShardStream` is the base to build one on: give it `records(shard)` (raw records, cheap to pass
over) and `decode(record)`; its `read(shard, start)` lets a resume and `data.on_bad_sample=skip` start inside a
shard. `JsonLines` is a worked example: one shard per file, one record per line.
"""

from __future__ import annotations

import glob
import itertools
import json
import os
from collections.abc import Callable, Iterator, Sequence

import torch
from torch.utils.data import IterableDataset

from .engine import shard_plan
from .engine.errors import UserError


class ShardStream(IterableDataset):
    """Base of a shard stream: `records(shard)` and `decode(record)` are yours; `transform` runs on each decoded
    record (in the workers). Iterated by a DataLoader of your own, it splits its shards over the workers too."""

    def __init__(self, shards: Sequence, sizes: Sequence[int] | None = None, transform: Callable | None = None):
        self.shards, self.sizes, self.transform = list(shards), None if sizes is None else list(sizes), transform

    def records(self, shard) -> Iterator:
        """The shard's raw records, in order: lines, tar members, rows."""
        raise NotImplementedError

    def decode(self, record):
        """One raw record as a sample (before `transform`)."""
        return record

    def read(self, shard, start: int = 0) -> Iterator:
        """The shard's samples from record `start` on: the records before it are passed over undecoded."""
        for record in itertools.islice(self.records(shard), start, None):
            sample = self.decode(record)
            yield self.transform(sample) if self.transform is not None else sample

    def __iter__(self) -> Iterator:
        return shard_plan.records(self)


class JsonLines(ShardStream):
    """JSON-lines files as a stream: one shard per file, one record per line, e.g. `{"x": [0.1, 0.7], "label": 1}`.

    A sample is `(torch.tensor(record[input_key], float32), int(record[label_key]))`. `files`: a glob pattern or a
    list of paths. `count`: count each file's lines up front, as `sizes` (no JSON parsing), so
    the steps of an epoch are known and torchrun processes stay in step."""

    def __init__(
        self, files: str | Sequence[str], input_key: str = "x", label_key: str = "label", count: bool = True,
        transform: Callable | None = None,
    ):  # fmt: skip
        paths = sorted(glob.glob(files)) if isinstance(files, str) else [str(f) for f in files]
        if not paths:
            raise UserError(f"JsonLines: no files match {files!r}: point data.train.files at your .jsonl files")
        missing = [p for p in paths if not os.path.isfile(p)]
        if missing:
            raise UserError(f"JsonLines: {missing[0]!r} is not a file: check data.train.files")
        self.input_key, self.label_key = input_key, label_key
        super().__init__(paths, [sum(1 for _ in self.records(p)) for p in paths] if count else None, transform)

    def records(self, shard: str) -> Iterator[str]:
        with open(shard) as f:
            yield from (line for line in f if line.strip())

    def decode(self, record: str):
        item = json.loads(record)
        return torch.tensor(item[self.input_key], dtype=torch.float32), int(item[self.label_key])
