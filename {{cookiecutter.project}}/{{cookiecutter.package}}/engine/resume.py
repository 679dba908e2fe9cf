"""Resuming: what makes a run the same run, find the checkpoint to continue from, check it fits this run, and say
where a run goes on (its parts loaded back: run_state.py; the files: checkpoint.py)."""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import platform
import shlex
from fnmatch import fnmatch
from importlib import metadata
from pathlib import Path

import numpy as np
import torch
from hydra.utils import to_absolute_path
from omegaconf import OmegaConf

from . import checkpoint
from .errors import UserError, yours
from .schema import flatten
{% if cookiecutter.with_streams == "yes" %}
from .shard_plan import RESTART_EPOCH, plain_stream_refusal
{% endif %}

log = logging.getLogger(__name__)


# The keys (fnmatch patterns on dotted keys) whose change keeps a resumed run the same run, and why; any other key
# makes another run (`changes_run`, with the exceptions: loader.batch_size, the workers under rng_mode=per_worker).
SAME_RUN = {
    "resume": "where to start from",
    "resume_strict": "how to treat changes",
    "max_steps": "a stop point, not a change of the run",
    "progress": "display only",
    "device": "the same run on other hardware (bits may differ)",
    "monitor.*": "health sampling",
    "checkpoint.*": "when and where checkpoints are written",
    "*every_steps": "how often something is logged or saved",
    "loader.*": "speed and memory of loading, except batch_size",
    "logger.*": "where the figures are sent",
    "process.omp_wait_policy": "how OpenMP's threads wait: speed only",
    "process.keep_freed_memory": "the allocator's thresholds: speed only",
    # error -> skip is how a run stopped on a bad sample goes on: up to the stop, no sample was skipped
    "data.on_bad_sample": "what a bad sample does, from here on",
{% if cookiecutter.with_streams == "yes" %}
    "data.stream_resume": "how a stream without a state goes on from a mid-epoch checkpoint",
{% endif %}
{% if cookiecutter.with_fsdp == "yes" %}
    "parallel.reshard_after_forward": "when FSDP frees gathered weights: memory and communication, not the math",
{% endif %}
    "callbacks.*": "what runs beside training; a stateful one's state is checked on its own (engine/callbacks.py)",
}


def changes_run(name: str, rng_mode: str) -> bool:
    """True when a different value of `name` makes a different run (so a resume must not change it silently)."""
    if name in ("loader.num_workers", "loader.persistent_workers"):
        return rng_mode == "per_worker"
    return name == "loader.batch_size" or not any(fnmatch(name, pattern) for pattern in SAME_RUN)


def written_by(ckpt: dict) -> int:
    """How many processes wrote the checkpoint."""
    return len(ckpt["ranks"])


def global_batch(ckpt: dict) -> int:
    """The checkpoint's global batch: samples per step over all processes."""
    return int(ckpt["progress"]["global_batch"])


def per_rank_batch(ckpt: dict, cfg, world_size: int) -> int:
    """This process's batch on resuming: the checkpoint's global batch over `world_size` processes, so the steps, the
    LR schedule and the optimizer stay those of the run, or a UserError when they cannot share it. A command that
    changes `loader.batch_size` (the per-process batch as the run started; resume_strict=false) gets its own."""
    batch = global_batch(ckpt)
    if cfg.loader.batch_size != ckpt["config"]["loader"]["batch_size"]:
        return cfg.loader.batch_size
    if batch % world_size:
        fits = [str(n) for n in range(1, batch + 1) if batch % n == 0]
        counts = ", ".join(fits[:-1]) + f" or {fits[-1]}" if len(fits) > 1 else fits[0]
        raise UserError(f"resume: its global batch of {batch} samples does not split over {world_size} processes: "
                        f"resume on {counts} processes (each then takes global batch / processes)")  # fmt: skip
    return batch // world_size


def locate(
    value: str, run_dir: Path, cfg, world_size: int | None, is_main: bool = True, only: list[str] | None = None
) -> Path | None:
    """The checkpoint to resume from: a path as given (relative to where the command was run), or for
    `resume=latest` this run folder's own last.pth (a requeued job), else the newest last.pth under
    `checkpoint.search_dir` that fits this run (`misfit`), each newer one skipped in a line; none: start fresh.
    eval.py asks with `only`, the keys its command sets, and `world_size=None` (any number of processes)."""
    if value != "latest":
        return Path(to_absolute_path(value))
    own = run_dir / "checkpoints" / "last.pth"{% if cookiecutter.with_fsdp == "yes" %}  # a file, or a sharded save's folder (a link to it){% endif +%}
    if own.exists():
        return own
    root = Path(to_absolute_path(cfg.checkpoint.search_dir))
    found = sorted(root.glob("**/checkpoints/last.pth"), key=lambda p: p.stat().st_mtime, reverse=True)
    for path in found:
        why = misfit(path, cfg, world_size, only)
        if why is None:
            return path
        if is_main:
            log.info("resume=latest: skipping %s: %s", path, why)
    if is_main:
        hint = "; to continue one of them with this config: resume=<its path> resume_strict=false" if found else ""
        log.warning("resume=latest: no checkpoints/last.pth under %s fits this run (%d skipped); starting fresh%s",
                    root, len(found), hint)  # fmt: skip
    return None


def misfit(path: Path, cfg, world_size: int | None, only: list[str] | None = None) -> str | None:
    """Why the checkpoint at `path` cannot continue this run, or None: a change of the run (`changes_run`), or a
    global batch `world_size` processes cannot share. Memory-mapped: the tensors are not read."""
    try:
        ckpt = checkpoint.load(path, mmap=True)
    except UserError:
        return "not a readable checkpoint of this project"
    changed = [c for c in changes(ckpt, cfg) if only is None or any(f"{c[0]}.".startswith(f"{k}.") for k in only)]
    if changed:
        return "its run differs: " + describe(changed)
    try:
        per_rank_batch(ckpt, cfg, world_size or 1)  # None: any number of processes, 1 among them
    except UserError as e:
        return str(e).removeprefix("resume: ")
    return None


ABSENT = "(absent)"


def changes(ckpt: dict, cfg, same: bool = False) -> list[tuple[str, object, object]]:
    """(key, checkpoint's value, this run's value) for every leaf key that differs and makes a different run
    (`changes_run`), dotted keys, sorted; with `same`, those that keep the run the same (bar the resume's own keys)."""
    old = flatten(ckpt["config"])
    new = flatten(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))
    return [
        (k, old.get(k, ABSENT), new.get(k, ABSENT))
        for k in sorted(old.keys() | new.keys())
        if old.get(k, ABSENT) != new.get(k, ABSENT)
        and changes_run(k, cfg.rng_mode.value) != same
        and k not in ("resume", "resume_strict", "max_steps")
    ]


def versions(config: dict) -> dict:
    """The versions a resume should run with (a checkpoint's `versions`): torch, torchvision, numpy, python, and the
    installed distribution of each `_target_`'s top module in `config` (albumentations, timm...), the project's own
    left out."""
    targets = {v.split(".")[0] for k, v in flatten(config).items() if k.split(".")[-1] == "_target_" and v}
    return {
        "torch": str(torch.__version__),
        # read, not imported: a project without images needs none
        "torchvision": next((d.version for d in metadata.distributions(name="torchvision")), None),
        "numpy": str(np.__version__),
        "python": platform.python_version(),
        **libraries(tuple(sorted(targets - {"torch", "torchvision", "numpy", __package__.split(".")[0]}))),
    }


@functools.cache  # read once a run, not at every save
def libraries(modules: tuple) -> dict:
    """{distribution: version} of the installed distributions that hold these top-level modules: the one named as
    the module (timm, albumentations), else the owners in every distribution's file list (sklearn: scikit-learn),
    a slower read (~0.3 s), made only then; the project's own modules have none."""
    found, owners = {}, None
    for module in modules:
        spec = importlib.util.find_spec(module)  # a top-level module: found, not imported
        if spec is None or spec.origin is None or yours(spec.origin):  # a module of the project's own (tests)
            continue
        try:
            dist = metadata.distribution(module)
            found[dist.metadata["Name"]] = dist.version
        except metadata.PackageNotFoundError:
            owners = metadata.packages_distributions() if owners is None else owners
            found.update({dist: metadata.version(dist) for dist in owners.get(module, [])})
    return found


def describe(changes) -> str:
    def show(v):
        text = "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
        return text if len(text) <= 60 else text[:57] + "..."

    return ", ".join(f"{k} {show(a)} -> {show(b)}" for k, a, b in changes)


def report(ckpt: dict, cfg, path: Path, loader) -> None:
    """Log a resume that went in (from where, on how many processes, what changed, where the restored train `loader`
    goes on), only after every refusal, so that no line says a refused run goes on."""
    run, same = changes(ckpt, cfg), changes(ckpt, cfg, same=True)
{% if cookiecutter.with_streams == "yes" %}
    same = [change for change in same if change[0] != "data.stream_resume"]  # its own warning says what it does
{% endif %}
    log.info("resuming from %s (step %d)", path, ckpt["step"])
    if (then := written_by(ckpt)) != loader.world_size:  # one wording whatever the counts ("on 1 processes" too)
        log.info("resuming a %d-process run on %d processes: global batch %d, %d per process (loader.batch_size=%d "
                 "as the run started)", then, loader.world_size, global_batch(ckpt),
                 loader.settings.batch_size, cfg.loader.batch_size)  # fmt: skip
    if run:
        log.warning("resume: resume_strict=false, going on with changed settings: %s; the LR schedule is the one "
                    "planned by this config, at step %d", describe(run), ckpt["step"])  # fmt: skip
    if same:
        log.info("resume: changed settings that keep the run the same: %s", describe(same))
    now = versions(OmegaConf.to_container(cfg, resolve=True))
    if moved := [(k, v, now.get(k)) for k, v in ckpt.get("versions", {}).items() if now.get(k) != v]:
        log.warning("resume: library versions differ from the checkpoint's (%s): the run may not stay bit-exact",
                    describe(moved))  # fmt: skip
    log.info("resumed from step %d (epoch %d, batch %d)", ckpt["step"], loader.epoch, loader.position)


def precheck(cfg, run_dir: Path, is_main: bool = True) -> tuple[Path, dict] | None:
    """The checkpoint a resume continues, located and read once for the whole run, or its refusal before the run
    folder is written: no file there, not a checkpoint, another run's config (unless resume_strict=false), another
    model or optimizer class, a number of processes that does not divide its global batch. Returns its path and
    contents, memory-mapped (None: none found, a fresh start); `is_main`: the rank that logs the search."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    found = locate(cfg.resume, run_dir, cfg, world_size, is_main)
    if found is None:
        return None
    ckpt = checkpoint.load(found, mmap=True)
    run = changes(ckpt, cfg)  # what makes a different run: one rule, `changes_run`; `report` logs what went through
    if run and cfg.resume_strict:
        raise UserError(
            f"resume: {found} was trained with another config: {describe(run)}; resume with the checkpoint's values, "
            "or add resume_strict=false to go on with this run's (the LR schedule is then re-planned)"
        )
    for group in ("model", "optim"):
        before, now = ckpt["config"][group].get("_target_"), cfg[group].get("_target_")
        if before != now:
            raise UserError(f"resume: the checkpoint was trained with {group} {before}, this run builds {now}: "
                            f"resume with the same {group}")  # fmt: skip
{% if cookiecutter.with_fsdp == "yes" %}
    sharded = cfg.parallel.strategy == "fsdp"
    if bool(ckpt.get("sharded")) != sharded:  # fsdp resumes sharded checkpoints, ddp whole ones
        kind, other = ("whole", "ddp") if sharded else ("sharded", "fsdp")
        package = __name__.split(".")[0]
        how = f"init_from={found}" if sharded else f"init_from on the file python -m {package}.export writes"
        raise UserError(f"resume: {found} is a {kind} checkpoint (parallel={other}): resume it with parallel={other}, "
                        f"or start from its weights with {how}")  # fmt: skip
{% endif %}
    per_rank_batch(ckpt, cfg, world_size)  # a number of processes that does not divide its global batch: refused
{% if cookiecutter.with_streams == "yes" %}
    loader = ckpt["ranks"][0]["loader"]
    if loader.get("kind") == "stream" and loader["position"] and written_by(ckpt) == world_size:
        workers = cfg.loader.num_workers  # loader=auto keeps a stream's pick: the checkpoint's workers
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        workers = {"tune": loader["num_workers"], "auto": cpus}.get(workers, workers)
        readers = world_size * max(workers, 1)
        why = plain_stream_refusal(loader, readers, loader["stateful"], cfg.data.get("stream_resume", "exact"))
        if why:
            raise UserError(f"resume: data.train {why}")
{% endif %}
    return found, ckpt


def where(run_dir: Path, last: Path, step: int, finished: bool, notes: list[str], max_steps: bool{% if cookiecutter.with_streams == "yes" %},
          restart_epoch: bool = False{% endif %}) -> str:  # fmt: skip
    """The closing line of a run: where it is (and `notes`, e.g. why it is not bit-exact), and the checkpoint with the
    overrides that go on from it (paths `short`; docs/resume.md shows how to train longer). `max_steps`: the stop
    point was reached.{% if cookiecutter.with_streams == "yes" %} `restart_epoch`: a stream without state stopped mid-epoch goes on only by starting that
    epoch over.{% endif %}"""
    at = f"{'finished' if finished else 'stopped'} at step {step}"
    said = "; ".join([at, f"run folder {short(run_dir)}", *notes])
    go_on = f"resume={shlex.quote(short(last))}"
    if finished:
        return f"{said}; to train longer: {go_on} with more epochs= and resume_strict=false (docs/resume.md)"
{% if cookiecutter.with_streams == "yes" %}
    if restart_epoch:
        go_on += f" {RESTART_EPOCH}"
{% endif %}
    later = f" and a max_steps above {step} (or none)" if max_steps else ""
    return f"{said}; to continue: the same command with {go_on}{later}"


def short(path: Path) -> str:
    """`path` relative to the working directory when it lies below it, else as it is."""
    here, path = Path.cwd().resolve(), Path(os.path.abspath(path))  # not resolved: last.pth may be a link
    return str(path.relative_to(here)) if path.is_relative_to(here) else str(path)
