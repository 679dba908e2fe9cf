"""Checkpoint files, all of them: how a save is written (atomically), whole or{% if cookiecutter.with_fsdp == "yes" %} sharded,{% endif %} and the one safe read of any
saved file and its one refusal (`read`), which `load` holds to this project's checkpoints. Everything saved is
tensors, numbers, strings and containers, so it loads with `torch.load(weights_only=True)`: a checkpoint cannot run
code. When the run saves and which epoch best.pth holds: `CheckpointPolicy`, `Best` (below); what goes into a
save: run_state.py; resuming: resume.py.
{% if cookiecutter.with_fsdp == "yes" %}

Sharded saves (`parallel=fsdp`): one torch.distributed.checkpoint (DCP) folder per save, published whole. A save is a
folder under `checkpoints/.saves/`: every rank's shards of the model, the optimizer and the EMA (`__<rank>_0.distcp`,
DCP's `.metadata`), and `run.pth`, the rest of the checkpoint. `last.pth`, `step-XXXXXXXX.pth` and `best.pth` are
symbolic links to such folders, each replaced by an atomic rename, so a reader sees a complete save or the previous
one. A kill mid-save leaves a `.tmp-*` folder no link names, removed when the next run starts writing there. DCP
reshards on load: W ranks' save resumes on W'. Loading reads no pickle that could run code: DCP's `.metadata` is
unpickled with only DCP's own classes and torch's dtypes allowed, and its non-tensor entries (the optimizer's group
settings) with `weights_only=True`.
{% endif %}
"""

from __future__ import annotations

{% if cookiecutter.with_fsdp == "yes" %}
import io
{% endif %}
import math
import os
{% if cookiecutter.with_fsdp == "yes" %}
import pickle
import shutil
import uuid
{% endif %}
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
{% if cookiecutter.with_fsdp == "yes" %}
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
{% endif %}

from . import distributed
from .errors import UserError, reason
from .files import durable{% if cookiecutter.with_fsdp == "yes" %}, sync{% endif +%}

FORMAT = 1
REQUIRED = ("format", "model", "optimizer", "scheduler", "epoch", "step", "ranks", "config")
LAST, BEST = "last.pth", "best.pth"  # the names of a run's checkpoints{% if cookiecutter.with_fsdp == "yes" %}, whole files or links to sharded saves{% endif +%}
{% if cookiecutter.with_fsdp == "yes" %}
RUN_FILE = "run.pth"  # inside a sharded save's folder: what is not sharded
SHARDED = ("model", "optimizer", "ema")  # the parts of the run's state (run_state.py) saved as each rank's shards
DTYPES = {name for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype)}
PATHS = {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"}
{% endif %}


class Checkpointer:
    """Writes `last.pth`, the newest `keep` files `step-XXXXXXXX.pth` and `best.pth` in one folder, atomically
    (`publish`): a kill mid-save leaves the previous files whole."""

    def __init__(self, folder: Path, keep: int):
        self.folder, self.keep = folder, keep
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob(".tmp-*.pth"):  # left by a save that was killed
            stale.unlink()

    def save(self, state: dict, best: dict | None = None) -> None:
        """`best`: the metrics.jsonl line of an epoch that is the best so far, then in `best.pth` too (`metrics`)."""
        if best is not None:
            publish({**state, "metrics": best}, self.folder / BEST)
        publish(state, self.folder / LAST, self.folder / f"step-{state['step']:08d}.pth" if self.keep > 0 else None)
        for old in sorted(self.folder.glob("step-*.pth"))[: -self.keep or None]:
            old.unlink()


def publish(state: dict, path: Path, also: Path | None = None) -> None:
    """Write `state` to `path` durably (files.py): a kill -9 mid-save leaves the previous file whole. `also`: the same
    bytes under a second name (a hard link)."""
    with durable(path, path.parent / f".tmp-{os.getpid()}.pth") as f:
        torch.save(state, f)
    if also is not None:
        also.unlink(missing_ok=True)
        os.link(path, also)


{% if cookiecutter.with_fsdp == "yes" %}
def read(path: Path, who: str, wanted: str, mmap: bool = False, whole: bool = False):
{% else %}
def read(path: Path, who: str, wanted: str, mmap: bool = False):
{% endif %}
    """What the file at `path` holds, read with `torch.load(weights_only=True)`, or one UserError `<who>: ...` saying
    why not (`wanted`: what to give instead of a path with nothing there). `mmap=True`: tensors read only when
    touched.{% if cookiecutter.with_fsdp == "yes" %} A sharded save's folder: its run.pth, with `model` and `ema` as shapes or, `whole`, gathered
    into whole tensors (`tensors`).{% endif +%}
    torch's warnings are held back until the read succeeds: on bytes that are no checkpoint it warns of a pickle
    protocol first, and the one refusal line says all there is to say."""
    if not path.exists():
        raise UserError(f"{who}: no checkpoint at {str(path)!r}: give the path of {wanted}")
    try:
        with warnings.catch_warnings(record=True) as held:
            warnings.simplefilter("always")
{% if cookiecutter.with_fsdp == "yes" %}
            found = path / RUN_FILE if path.is_dir() else path
            loaded = torch.load(found, map_location="cpu", weights_only=True, mmap=mmap)
            if path.is_dir():
                loaded = {**loaded, **tensors(path, whole)}
{% else %}
            loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
{% endif %}
    except Exception as e:  # truncated zip, random bytes, a pickle asking for code: all refused the same way
        if mmap:  # torch maps zip archives only: anything else is refused as a plain read refuses it, same message
            return read(path, who, wanted)
        raise UserError(
{% if cookiecutter.with_fsdp == "yes" %}
            f"{who}: {str(path)!r} is not a readable {'sharded ' * path.is_dir()}checkpoint ({reason(e)}"
{% else %}
            f"{who}: {str(path)!r} is not a readable checkpoint ({reason(e)}"
{% endif %}
            "); it is truncated, corrupt or not from this project: pick another, e.g. an older "
            "checkpoints/step-*.pth"
        ) from None
    for w in held:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    return loaded


{% if cookiecutter.with_fsdp == "yes" %}
def load(path: Path, mmap: bool = False, whole: bool = False, who: str = "resume", latest: str = "resume") -> dict:
{% else %}
def load(path: Path, mmap: bool = False, who: str = "resume", latest: str = "resume") -> dict:
{% endif %}
    """The checkpoint of this project at `path` (`read`), or a UserError saying why not. `latest`: the key that would
    find one instead (resume=latest, ckpt=latest)."""
    wanted = "a checkpoints/*.pth file" + (f", or {latest}=latest" if latest else "")
    ckpt = read(path, who, wanted, mmap{% if cookiecutter.with_fsdp == "yes" %}, whole{% endif %})
{% if cookiecutter.with_fsdp == "yes" %}
    required = REQUIRED if path.is_file() else [k for k in REQUIRED if k != "optimizer"]  # a sharded save's: in shards
    missing = [k for k in required if not isinstance(ckpt, dict) or k not in ckpt]
{% else %}
    missing = [k for k in REQUIRED if not isinstance(ckpt, dict) or k not in ckpt]
{% endif %}
    if missing:
        raise UserError(f"{who}: {str(path)!r} is not a checkpoint of this project (missing {', '.join(missing)})")
    if ckpt["format"] != FORMAT:
        raise UserError(f"{who}: {str(path)!r} has checkpoint format {ckpt['format']}, this code reads {FORMAT}")
    return ckpt


def misfit(own: dict, saved: dict) -> str:
    """Why the tensors `saved` do not load into a model whose state_dict is `own`, in one line: its missing,
    unexpected and reshaped names, four of each at most; "" when they fit."""
    odd = {"missing": [k for k in own if k not in saved], "unexpected": [k for k in saved if k not in own],
           "other shape": [k for k in own if k in saved and saved[k].shape != own[k].shape]}  # fmt: skip
    return "; ".join(f"{label} {', '.join(names[:4])}" + (f" and {len(names) - 4} more" if len(names) > 4 else "")
                     for label, names in odd.items() if names)  # fmt: skip
{% if cookiecutter.with_fsdp == "yes" %}


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
{% endif %}


def improves(value: float, best: float | None, mode: str, min_delta: float = 0.0) -> bool:
    """Whether `value` beats `best` by more than `min_delta` (`mode` max: higher is better; min: lower):
    anything but a NaN beats no best at all, and a NaN beats nothing. best.pth and EarlyStopping judge by it."""
    if math.isnan(value):
        return False
    return best is None or (value - best if mode == "max" else best - value) > min_delta


@dataclass
class Best:
    """Which epoch `best.pth` holds: the best `monitor` value so far (`train_loss` or a `val_<name>`), `mode`
    max or min. The value travels in every checkpoint (`best`), so a resumed run, in any folder, never
    overwrites a better best.pth."""

    monitor: str
    mode: str
    value: float | None = None

    def state(self) -> dict:
        return asdict(self)

    def load(self, saved: dict | None) -> None:
        """A checkpoint's best (its `state()`), when it was judged by the same rule."""
        if saved and saved["monitor"] == self.monitor and saved["mode"] == self.mode:
            self.value = saved["value"]

    def judge(self, record: dict) -> bool:
        """Whether this epoch is the best so far, then kept (the dry step refused a `monitor` the task does
        not report). A NaN, a diverged epoch, is never the best, and must not block the ones after it."""
        better = improves(record[self.monitor], self.value, self.mode)
        if better:
            self.value = record[self.monitor]
        return better


class CheckpointPolicy:
    """When the run saves: `last.pth` (plus `step-*.pth`) at every epoch end, every `every_steps` optimizer
    steps, at a stop and at `max_steps`; `best.pth` at an epoch end that beats the best so far. All ranks
    wait for the write: rank 0's{% if cookiecutter.with_fsdp == "yes" %} (parallel=fsdp: every rank's shards){% endif %}."""

    def __init__(self, folder: Path, cfg, world, snapshot: Callable, saved_step: int | None = None{% if cookiecutter.with_fsdp == "yes" %},
                 sharded: bool = False{% endif %}):  # fmt: skip
{% if cookiecutter.with_fsdp == "yes" %}
        if sharded:
            self.writer = ShardedCheckpointer(folder, cfg.keep, world)
        else:
            self.writer = Checkpointer(folder, cfg.keep) if world.is_main else None
{% else %}
        self.writer = Checkpointer(folder, cfg.keep) if world.is_main else None
{% endif %}
        # cfg: the run's `checkpoint` node; snapshot(run): the state to save (run_state.snapshot)
        self.folder, self.every_steps, self.world, self.snapshot = folder, cfg.every_steps, world, snapshot
        self.best = Best(cfg.monitor, cfg.mode.value)  # the best epoch so far, a resumed run's included
        self.saved_step = saved_step  # the step of the newest checkpoint (a resume's, at first)

    def due(self, step: int) -> bool:
        """A save every `every_steps` steps, besides the ones at epoch ends and stops."""
        return bool(self.every_steps) and step % self.every_steps == 0

    def save(self, run, record: dict | None = None) -> None:
        """Save `run`'s parts (engine/run.py); `record`, at an epoch end, is that epoch's metrics.jsonl line,
        kept in best.pth when the epoch is the best so far."""
        better = record is not None and self.best.judge(record)
        state = self.snapshot(run)  # every rank: collectives among the parts
        if self.writer is not None:
            self.writer.save(state, record if better else None)
        self.saved_step = run.step
        distributed.gather_all(None, self.world)  # a barrier: no rank goes on before the save is on disk

    def diverged(self, first_bad: int, step: int) -> str:
        """The one line for a loss that became NaN or inf: nothing is saved past the last good checkpoint."""
        then = (
            f"{self.folder / 'last.pth'} holds step {self.saved_step}, the last good weights: lower optim.lr or set "
            "optim.grad_clip, then resume from it with resume_strict=false"
            if self.saved_step
            else "no checkpoint was written yet: lower optim.lr or set optim.grad_clip and start again"
        )
        return f"the loss became nan or inf at step {first_bad} (seen at step {step}): stopped without saving; {then}"

    @property
    def last(self) -> Path | None:
        """The newest `last.pth` on rank 0, once one is on disk."""
        last = self.folder / LAST
        return last if self.world.is_main and last.exists() else None
