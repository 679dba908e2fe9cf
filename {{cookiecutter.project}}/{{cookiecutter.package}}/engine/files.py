"""Durable files: written through a temporary file beside them, synced, then renamed into place with the
rename synced too, so a reader, or a run after a crash, finds the previous file or the whole new one."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def durable(path: Path, tmp: Path | None = None):
    """A file to write `path` through: `tmp` (by default `.<name>.tmp` beside it), renamed over `path`
    once whole."""
    tmp = tmp or path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        yield f
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    sync(path.parent)  # the rename itself


def sync(path: Path) -> None:
    """fsync a file or a folder: its bytes, or the renames in it, are durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
