"""The one safe read of a saved file: `torch.load(weights_only=True)`, so a file cannot run code when it loads."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch


def read(path: Path, mmap: bool = False):
    """`torch.load(weights_only=True)` of `path`, with the warnings torch gives while reading held back until the read
    succeeds: bytes that are no checkpoint can make torch warn of a pickle protocol first, and the one `error:` line
    that follows says all there is to say."""
    with warnings.catch_warnings(record=True) as held:
        warnings.simplefilter("always")
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    for w in held:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    return loaded
