"""Sharded checkpoints (`parallel=fsdp`): one torch.distributed.checkpoint (DCP) folder per save, published whole.

A save is a folder under `checkpoints/.saves/`: every rank's shards of the model, the optimizer and the EMA
(`__<rank>_0.distcp`, DCP's `.metadata`), and `run.pth`, the rest of the checkpoint as checkpoint.py writes it.
`last.pth`, `step-XXXXXXXX.pth` and `best.pth` are symbolic links to such folders, each replaced by an atomic rename,
so a reader sees a complete save or the previous one. A kill mid-save leaves a `.tmp-*` folder no link names, removed
when the next run starts writing there. DCP reshards on load: W ranks' save resumes on W'.

Loading reads no pickle that could run code: DCP's `.metadata` is unpickled with only DCP's own classes and
torch's dtypes allowed, and its non-tensor entries (the optimizer's group settings) with `weights_only=True`.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import uuid
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from . import distributed
from .files import sync

LAST, BEST = "last.pth", "best.pth"  # the names of a run's checkpoints, whole files or links to sharded saves
RUN_FILE = "run.pth"  # inside a save's folder: what is not sharded
SHARDED = ("model", "optimizer", "ema")  # the parts of the run's state (run_state.py) saved as each rank's shards
DTYPES = {name for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype)}
PATHS = {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"}


class MetadataUnpickler(pickle.Unpickler):
    """DCP's `.metadata` with only the classes such a file holds: DCP's dataclasses, torch's dtypes and sizes."""

    def find_class(self, module: str, name: str):
        allowed = (
            module.startswith("torch.distributed.checkpoint.")
            or (module == "torch" and (name == "Size" or name in DTYPES))
            or (module == "torch.serialization" and name == "_get_layout")  # how DCP pickles torch.strided
            or (module == "pathlib" and name in PATHS)
            or (module == "collections" and name == "OrderedDict")
        )
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's metadata")
        return super().find_class(module, name)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load, with its non-tensor entries read `weights_only=True` (DCP itself unpickles them fully)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        checked = io.BytesIO()
        torch.save(torch.load(value, weights_only=True), checked)  # refuses anything but data, then hands it on
        checked.seek(0)
        super().load_bytes(read_item, checked)


def tensors(path: Path, whole: bool) -> dict:
    """The save's `model` and `ema` (None without) for checkpoint.read: meta tensors, nothing read (`sharded`: a resume
    loads the shards, `fill`), or with `whole` gathered into whole CPU tensors (eval.py, init_from, export)."""
    with open(path / ".metadata", "rb") as f:  # every tensor's name, shape and dtype
        found = MetadataUnpickler(f).load()
    if not isinstance(found, Metadata):
        raise pickle.UnpicklingError(f"a {type(found).__name__}, not DCP metadata")
    wanted = {
        name: torch.empty(item.size, dtype=item.properties.dtype, device="cpu" if whole else "meta")
        for name, item in found.state_dict_metadata.items()
        if name.startswith(("model.", "ema.")) and isinstance(item, TensorStorageMetadata)
    }
    if whole:
        # DCP's note that it loads in one process, which is the point here: known by where it comes from, not by its
        # words, so a new wording stays silent too
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed\.checkpoint\.")
            dcp.load(wanted, checkpoint_id=path, planner=SafeLoadPlanner(), no_dist=True)
    found = {"sharded": not whole}
    for part in ("model", "ema"):
        found[part] = {k.removeprefix(part + "."): v for k, v in wanted.items() if k.startswith(part + ".")} or None
    return found


def fill(path: Path, live: dict) -> dict:
    """The save's shards read into `live`, the run's own sharded tensors by part (`SHARDED`), resharded to
    this run's ranks (a collective); returns `live`, now holding the saved values."""
    dcp.load(live, checkpoint_id=path, planner=SafeLoadPlanner())
    return live


class ShardedCheckpointer:
    """Writes sharded saves and the links `last.pth`, `step-XXXXXXXX.pth` (the newest `keep`) and `best.pth`.
    Every rank calls `save`; rank 0 alone publishes."""

    def __init__(self, folder: Path, keep: int, world):
        self.folder, self.keep, self.world = folder, keep, world
        self.saves = folder / ".saves"
        if world.is_main:
            self.saves.mkdir(parents=True, exist_ok=True)
            for stale in [*self.saves.glob(".tmp-*"), *folder.glob(".link-*")]:  # a save or link cut short
                shutil.rmtree(stale) if stale.is_dir() and not stale.is_symlink() else stale.unlink()
            self._collect()
        distributed.gather_all(None, world)  # a barrier: no rank goes on before rank 0 has tidied up

    def save(self, state: dict, best: dict | None = None) -> None:
        """Write `state` as one save, its tensor parts (`SHARDED`) as every rank's shards, the rest as rank 0's
        run.pth; link it as last (step-N, and best.pth with `best`, the epoch's metrics.jsonl line, in `metrics`)."""
        step = state["step"]
        tmp = self.saves / f".tmp-{step:08d}"
        if self.world.is_main:
            tmp.mkdir(parents=True, exist_ok=True)
        distributed.gather_all(None, self.world)  # a barrier: the folder exists for every rank
        shards = {name: state[name] for name in SHARDED if state.get(name) is not None}
        dcp.save(shards, checkpoint_id=tmp)  # a collective: returns once every rank's shards and .metadata are on disk
        if not self.world.is_main:
            return
        rest = {name: value for name, value in state.items() if name not in SHARDED}
        torch.save(rest if best is None else {**rest, "metrics": best}, tmp / RUN_FILE)
        sync(tmp / RUN_FILE)
        sync(tmp)
        done = self.saves / f"{step:08d}-{uuid.uuid4().hex[:8]}"
        os.rename(tmp, done)  # complete now; no link names it yet
        sync(self.saves)
        self._link(done, self.folder / LAST)
        if self.keep > 0:
            self._link(done, self.folder / f"step-{step:08d}.pth")
        for old in sorted(self.folder.glob("step-*.pth"))[: -self.keep or None]:  # as a whole-file save rotates
            old.unlink()
        if best is not None:
            self._link(done, self.folder / BEST)
        sync(self.folder)
        self._collect()

    def _link(self, target: Path, name: Path) -> None:
        """`name` -> `target`, replaced atomically: a new link under a temporary name, renamed over the old one."""
        tmp = self.folder / f".link-{name.name}"
        tmp.unlink(missing_ok=True)
        os.symlink(os.path.relpath(target, self.folder), tmp)  # relative: the run folder may be moved or copied
        os.replace(tmp, name)

    def _collect(self) -> None:
        """Remove the saves no link names any more (rotated out, replaced)."""
        named = {link.resolve() for link in self.folder.glob("*.pth") if link.is_symlink()}
        for save in self.saves.iterdir():
            if not save.name.startswith(".") and save.resolve() not in named:
                shutil.rmtree(save)
