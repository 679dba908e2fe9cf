"""The config schema and the checks every run passes before it does any work.

Defaults live in one place, the YAML files under `conf/`: the schema below holds no values (every
field is MISSING), only each key's type (Hydra refuses `epochs=ten` or `device=gpu`) and its range
(`check()` refuses `epochs=-1`). Adding a key takes one line here (type and check) and one
commented line in the YAML that sets it; a YAML that forgets it fails with "... has no value".

`check(cfg)` (called first thing by train.py) refuses, in one line each: a value out of range, a
key the schema does not know (also one added with `+`, which Hydra lets through), a required value
left at `???`, and a data set, model, optimizer or task that cannot be built or run. The groups whose
keys depend on the chosen `_target_` (data, model, optim, task) are open: each node's keys are checked
against its target's signature, the keys the shipped targets give a meaning are range-checked, and a
dry step (`dry_step`) runs the task's loss and metrics on two real samples of the configured data, so
a wrong argument fails here, not mid-run.

Where they run: `CheckBeforeRun` (a Hydra callback) runs `check()` and the data and resume checks that need
no data set opened (`before_work`) before Hydra creates the run folder; `check_command_line` (train.py,
before Hydra starts) turns what Hydra reports over several lines (a mistyped key, a wrong type, an unknown
group option) into the same one line. train() runs `check()` again: a multirun's jobs meet it there.
"""

import dataclasses
import difflib
import inspect
import json
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import torch
from hydra._internal.utils import _locate  # what instantiate uses; hydra.utils.get_object also logs an error
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.utils import instantiate
from omegaconf import MISSING, DictConfig, OmegaConf, open_dict, read_write

from .distributed import job_ranks
from .errors import UserError

SEED_MAX = 2**32 - 1  # numpy's np.random.seed takes 0 .. 2**32 - 1; torch and python take at least that


# Checks: each returns None when the value is fine, else what it should be.
def integer(low: int, high: int | None = None, null: str | None = None) -> Callable:
    def check(v):
        if v is None and null:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or v < low or (high is not None and v > high):
            span = f"between {low} and {high}" if high is not None else f">= {low}"
            return f"an integer {span}" + (f", or null ({null})" if null else "")

    return check


def number(low: float, high: float | None = None, above: bool = False, null: str | None = None) -> Callable:
    def check(v):
        if v is None and null:
            return None
        bad = isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
        if bad or (v <= low if above else v < low) or (high is not None and v > high):
            span = f"> {low}" if above else f">= {low}"
            span = f"in [{low}, {high}]" if high is not None else span
            return f"a number {span}" + (f", or null ({null})" if null else "")

    return check


def integer_or(word: str, low: int) -> Callable:
    def check(v):
        if v != word and integer(low)(v):
            return f"an integer >= {low} or '{word}'"

    return check


def flag_or(word: str) -> Callable:
    def check(v):
        return None if isinstance(v, bool) or v == word else f"true, false or '{word}'"

    return check


def text(null: str | None = None) -> Callable:
    def check(v):
        if v is None and null:
            return None
        if not isinstance(v, str) or not v.strip():
            return "a non-empty string" + (f", or null ({null})" if null else "")

    return check


def one_of(*allowed, also=()) -> Callable:
    """One of the strings `allowed` (or a value in `also`, e.g. the booleans an older config used)."""

    def check(v):
        if not (isinstance(v, str) and v in allowed) and not any(v is a for a in also):
            shown = ", ".join(allowed[:-1]) + f" or {allowed[-1]}"
            return shown + (f" ({'/'.join(str(a).lower() for a in also)} also work)" if also else "")

    return check


def typed() -> Callable:
    """Hydra's schema already refuses anything but the field's type (bool, an Enum)."""
    return lambda v: None


def key(check: Callable) -> Any:
    """A schema field: no default (the YAML holds it), and the range check `check()` applies."""
    return field(default=MISSING, metadata={"check": check})


class Device(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class RngMode(str, Enum):
    per_sample = "per_sample"
    per_worker = "per_worker"


class OnBudget(str, Enum):
    adjust = "adjust"  # lower prefetch_factor, then num_workers, until the prefetch plan fits
    error = "error"  # refuse to start instead


class BestMode(str, Enum):
    max = "max"  # higher is better (accuracy)
    min = "min"  # lower is better (a loss)


@dataclass
class LoaderConfig:
    batch_size: int = key(integer(1))
    num_workers: Any = key(integer_or("auto", 0))
    prefetch_factor: int | None = key(integer(1, null="PyTorch's default, 2"))
    pin_memory: Any = key(flag_or("auto"))
    persistent_workers: bool = key(typed())
    timeout: float = key(number(0))
    max_prefetch_mib: float | None = key(number(0, above=True, null="no budget"))
    on_budget: OnBudget = key(typed())


@dataclass
class EmaConfig:
    decay: float | None = key(number(0, 1, null="off"))


@dataclass
class CheckpointConfig:
    every_steps: int | None = key(integer(1, null="epoch ends only"))
    keep: int = key(integer(0))
    search_dir: str = key(text())
    monitor: str = key(text())  # best.pth keeps the epoch with the best value of this metrics.jsonl key
    mode: BestMode = key(typed())


@dataclass
class MonitorConfig:
    every_steps: int = key(integer(0))


class WandbMode(str, Enum):
    online = "online"  # to the W&B server (wandb login first)
    offline = "offline"  # files under <run folder>/wandb/, uploaded later with `wandb sync`
    disabled = "disabled"  # every call a no-op


class OnUnreachable(str, Enum):
    error = "error"  # refuse to start, in one line
    local = "local"  # log to a database in the run folder instead (mlflow.db), and say so


@dataclass
class MlflowConfig:
    tracking_uri: str = key(text())
    experiment_name: str | None = key(text(null="the run's name without its time; a sweep's folder in a multirun"))
    on_unreachable: OnUnreachable = key(typed())
    log_checkpoints: bool = key(typed())


@dataclass
class WandbConfig:
    mode: WandbMode = key(typed())
    project: str = key(text())
    entity: str | None = key(text(null="your default entity"))


def loggers(v):
    from .tracking import TRACKERS

    if isinstance(v, str) or not isinstance(v, Sequence) or any(name not in TRACKERS for name in v):
        return f"a list of {', '.join(TRACKERS)}"


@dataclass
class LoggerConfig:
    use: list[str] = key(loggers)
    timeout_s: float = key(number(0, above=True))
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class Config:
    seed: int = key(integer(0, SEED_MAX))
    epochs: int = key(integer(1))
    max_steps: int | None = key(integer(1, null="run all epochs"))
    resume: str | None = key(text(null="start fresh"))
    resume_strict: bool = key(typed())
    device: Device = key(typed())
    deterministic: bool = key(typed())
    amp: Any = key(one_of("off", "bf16", "fp16", also=(True, False)))  # true/false (older configs) mean fp16/off
    channels_last: bool = key(typed())
    compile: bool = key(typed())
    device_prefetch: bool = key(typed())
    log_every_steps: int = key(integer(1))
    progress: bool = key(typed())
    rng_mode: RngMode = key(typed())
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    accumulate_steps: int = key(integer(1))
    init_from: str | None = key(text(null="the model's own initialisation"))
    init_strict: bool = key(typed())
    val_every_steps: int | None = key(integer(1, null="at epoch ends only"))
    ema: EmaConfig = field(default_factory=EmaConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    data: Any = MISSING  # open groups: their keys depend on the `_target_` chosen (conf/data, model, optim, task)
    model: Any = MISSING
    optim: Any = MISSING
    task: Any = MISSING
    schedule: Any = MISSING


# Keys of the open groups that the shipped targets give a meaning: checked when present and the group's target is
# one of the shipped ones (this package's, torch's optimizers), since a target of yours may mean something else.
OPEN_KEYS = {
    "data.num_classes": integer(2),
    "data.image_size": integer(1),
    "data.per_class": integer(1),
    "data.root": text(),
    "model.width": integer(1),
    "optim.lr": number(0, above=True),
    "optim.weight_decay": number(0),
    "optim.momentum": number(0, 1),
    "task.label_smoothing": number(0, 0.999),
    "schedule.warmup_steps": integer(0),
    "schedule.min_lr_ratio": number(0, 1),
    "schedule.total_steps": integer(1, null="the planned epochs' steps"),
}
# The loop's own keys in open groups (engine/optim.py): checked whatever the group's target.
LOOP_OPEN_KEYS = {
    "optim.grad_clip": number(0, above=True, null="off"),
    "optim.decay_norm_and_bias": lambda v: None if isinstance(v, bool) else "true or false",
    "data.on_bad_sample": one_of("error", "skip"),
}
SHIPPED = {
    "data": "data.train._target_",
    "model": "model._target_",
    "optim": "optim._target_",
    "task": "task._target_",
    "schedule": "schedule._target_",
}
PACKAGE = __name__.split(".")[0]
REQUIRED_OPEN = (
    "data.train._target_",
    "data.val._target_",
    "model._target_",
    "optim._target_",
    "task._target_",
    "schedule._target_",
)

# Resume: which keys, when changed, make a resumed run a different run (resume.compare). The rule: every key
# does, except those matched here (fnmatch patterns on dotted keys); with rng_mode=per_worker,
# loader.num_workers and loader.persistent_workers do too (each worker's own RNG stream feeds the data).
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
    # error -> skip is how a run stopped on a bad sample goes on: up to the stop, no sample was skipped
    "data.on_bad_sample": "what a bad sample does, from here on",
}
RUN_KEYS_UNDER_SAME = {
    "loader.batch_size": None,
    "loader.num_workers": "per_worker",
    "loader.persistent_workers": "per_worker",
}


def changes_run(name: str, rng_mode: str) -> bool:
    """True when a different value of `name` makes a different run (so a resume must not change it silently)."""
    if name in RUN_KEYS_UNDER_SAME:
        only = RUN_KEYS_UNDER_SAME[name]
        return only is None or only == rng_mode
    return not any(fnmatch(name, pattern) for pattern in SAME_RUN)


def register() -> None:
    """The schema, for Hydra to check conf/config.yaml against: called by the entry points before they compose."""
    ConfigStore.instance().store(name="schema", node=Config)


def run_name(*parts) -> str:
    """`${run_name:a,b,...}`: the parts that are set, joined by `_`, safe as one folder name (no `/`, <= 150 chars)."""
    name = "_".join(str(p) for p in parts if p not in (None, "", "null"))
    return name.replace("/", "-")[:150]


# hydra.run.dir / hydra.sweep.subdir use ${run_name:...}. Registered on import rather than in register(): a submitit
# job unpickles main() and resolves its folder there without running train.py's `__main__` block, but it does import
# this module (main's code refers to it by name).
OmegaConf.register_new_resolver("run_name", run_name, replace=True)


_checked: set[str] = set()  # configs check() passed in this process: the Hydra callback's, then train()'s


def check(cfg: DictConfig, choices: dict | None = None, overrides: list[str] | None = None, dry: bool = True) -> None:
    """Refuse a bad config in one line (UserError), before any work. `choices`/`overrides` (Hydra's) make the
    message for a missing value name the file and the command. A config already checked in this process (by the
    Hydra callback, before train() checks it again) is not checked twice: the dry step builds the data sets."""
    missing(cfg, choices or {}, overrides or [])
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True)
    except Exception as e:  # an interpolation to a key that is not there, a bad resolver
        raise UserError(f"config: {str(e).splitlines()[0]}") from None
    fingerprint = json.dumps(resolved, sort_keys=True, default=str)
    if fingerprint in _checked:
        return
    unknown(cfg, Config, "")
    ranges(cfg, Config, "")
    from .tracking import chosen

    chosen(cfg)  # a logger whose package is missing: the line names the extra to install
    for name, rule in OPEN_KEYS.items():
        if OmegaConf.select(cfg, name, default=MISSING) is not MISSING and shipped(cfg, name.split(".")[0]):
            refuse_if(name, OmegaConf.select(cfg, name), rule)
    for name, rule in LOOP_OPEN_KEYS.items():
        if OmegaConf.select(cfg, name, default=MISSING) is not MISSING:
            refuse_if(name, OmegaConf.select(cfg, name), rule)
    for name in REQUIRED_OPEN:
        if OmegaConf.select(cfg, name, default=None) is None:
            group = name.split(".")[0]
            raise UserError(f"{name} is not set: the {group} group needs it (see conf/{group}/)")
    added_data_keys(cfg, overrides or [])
    raw = OmegaConf.to_container(cfg, resolve=False)
    targets(raw, "")
    from .optim import LOOP_KEYS

    raw["optim"] = {k: v for k, v in raw["optim"].items() if k not in LOOP_KEYS}  # the loop's, not the optimizer's
    for group in ("data", "model", "optim", "task", "schedule"):
        arguments(raw[group], f"{group}.")
    if not dry:  # the checks that open nothing; the Hydra callback runs the cheap prechecks before the dry step
        return
    from .dry_step import dry_step  # it builds what the run builds: datasets, model, task

    dry_step(cfg)
    _checked.add(fingerprint)


def shipped(cfg, group: str) -> bool:
    """Whether the group's target is one this project ships (so its keys mean what OPEN_KEYS says)."""
    target = str(OmegaConf.select(cfg, SHIPPED.get(group, ""), default="") or "")
    return target.startswith((f"{PACKAGE}.", "torch.optim.", "torchvision."))


def missing(cfg, choices: dict, overrides: list[str]) -> None:
    keys = sorted(_missing(OmegaConf.to_container(cfg, resolve=False)))  # unresolved: `${data.root}` is not `???`
    if not keys:
        return
    group = keys[0].split(".")[0]
    where = f"conf/{group}/{choices[group]}.yaml" if group in choices else "conf/config.yaml"
    command = " ".join(["python train.py", *overrides, *(f"{k}=<value>" for k in keys)])
    have, it = ("has", "it") if len(keys) == 1 else ("have", "them")
    raise UserError(f"{', '.join(keys)} {have} no value ('???' in {where}): set {it} on the command line: {command}")


def _missing(tree, prefix: str = "") -> list[str]:
    if isinstance(tree, dict):
        return [k for name, value in tree.items() for k in _missing(value, f"{prefix}{name}.")]
    if isinstance(tree, list):
        return [k for i, value in enumerate(tree) for k in _missing(value, f"{prefix}{i}.")]
    return [prefix[:-1]] if tree == MISSING else []


def refuse_if(name: str, value, rule: Callable) -> None:
    wanted = rule(value)
    if wanted:
        raise UserError(f"{name} must be {wanted}, got {value!r}")


def ranges(cfg, schema, prefix: str) -> None:
    for f in dataclasses.fields(schema):
        sub = _schema_of(f)
        if sub is not None:
            ranges(cfg[f.name], sub, f"{prefix}{f.name}.")
        elif "check" in f.metadata:
            value = cfg[f.name]
            refuse_if(prefix + f.name, value.value if isinstance(value, Enum) else value, f.metadata["check"])


def unknown(cfg, schema, prefix: str) -> None:
    """Keys the schema does not have: Hydra refuses `loader.num_worker=3` but lets `+loader.num_worker=3` in."""
    known = {f.name: f for f in dataclasses.fields(schema)}
    for name in cfg:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
            raise UserError(f"unknown config key {prefix}{name}{hint}: the schema in config.py has no such key")
        sub = _schema_of(known[name])
        if sub is not None:
            unknown(cfg[name], sub, f"{prefix}{name}.")


def _schema_of(f: dataclasses.Field):
    """The dataclass of a nested group field (loader, schedule, ...), else None."""
    factory = f.default_factory
    return factory if factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory) else None


# data.* keys the loop reads itself (run.py), besides the data sets' own `${data.<key>}` values
LOOP_DATA_KEYS = ("num_classes", "normalize", "collate", "batch_transform", "on_bad_sample")


def added_data_keys(cfg, overrides: list[str]) -> None:
    """data.* values reach the datasets through interpolations (`${data.root}`): a key added on the command line
    (`+data.per_clas=10`) that no node refers to would be silently ignored, so it is refused."""
    raw = str(OmegaConf.to_container(cfg.data, resolve=False))
    for override in overrides:
        found = re.match(r"\+{1,2}data\.(\w+)=", override)
        if found and found[1] not in LOOP_DATA_KEYS and "${data." + found[1] + "}" not in raw:
            close = difflib.get_close_matches(found[1], [k for k in cfg.data if k != found[1]], n=1)
            hint = f" (did you mean data.{close[0]}?)" if close else ""
            raise UserError(
                f"data.{found[1]} is not used by data.train or data.val{hint}: "
                "remove it, or refer to it as ${data." + found[1] + "}"
            )


def targets(tree, prefix: str) -> None:
    """Every `_target_` names something importable (a typo would otherwise fail only when that node is built)."""
    if not isinstance(tree, dict):
        return
    if isinstance(tree.get("_target_"), str):
        try:
            _locate(tree["_target_"])
        except Exception as e:
            raise UserError(f"{prefix}_target_={tree['_target_']} cannot be imported: {_reason(e)}") from None
    for name, value in tree.items():
        targets(value, f"{prefix}{name}.")


def arguments(tree, prefix: str) -> None:
    """Every key of a `_target_` node is an argument its target takes: a user's own class may take any arguments,
    so they are checked against its signature (a target taking **kwargs takes anything)."""
    if isinstance(tree, list):
        for i, value in enumerate(tree):
            arguments(value, f"{prefix}{i}.")
        return
    if not isinstance(tree, dict):
        return
    if isinstance(tree.get("_target_"), str):
        target = tree["_target_"]
        try:
            parameters = inspect.signature(_locate(target)).parameters.values()
        except (TypeError, ValueError):  # a builtin without a signature: nothing to check against
            parameters = None
        if parameters is not None and not any(p.kind is p.VAR_KEYWORD for p in parameters):
            takes = [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
            for name in tree:
                if not (name.startswith("_") and name.endswith("_")) and name not in takes:
                    close = difflib.get_close_matches(name, takes, n=1)
                    hint = f"did you mean {prefix}{close[0]}? " if close else ""
                    raise UserError(
                        f"{prefix}{name} is not an argument of {target} ({hint}it takes {', '.join(takes) or 'none'})"
                    )
    for name, value in tree.items():
        if not name.startswith("_"):
            arguments(value, f"{prefix}{name}.")


def _reason(e: BaseException) -> str:
    """The error a `_target_` raised, without Hydra's wrapping: one line."""
    inner = e.__cause__ or e
    lines = [line.strip() for line in str(inner).splitlines() if line.strip()]
    return f"{type(inner).__name__}: {lines[0] if lines else ''}"[:300]


def check_data(train_set, val_set, num_classes: int | None) -> None:
    """Before training: data.num_classes (when the data config has one) against the classes a folder data set
    found (its `classes`), so a wrong count is one line here rather than `IndexError: Target 6 is out of bounds`
    mid-run."""
    check_classes(
        {name: getattr(ds, "classes", None) for name, ds in (("train", train_set), ("val", val_set))}, num_classes
    )


def check_classes(found: dict, num_classes: int | None) -> None:
    """`found`: split -> the class names its data holds, or None where the data set does not say."""
    found = {name: list(classes or []) for name, classes in found.items()}
    for name, classes in found.items():
        if classes and num_classes is not None and len(classes) != num_classes:
            shown = ", ".join(classes[:4]) + (", ..." if len(classes) > 4 else "")
            raise UserError(
                f"data.num_classes={num_classes} but the {name} data holds {len(classes)} classes "
                f"({shown}): set data.num_classes={len(classes)}"
            )
    if found.get("train") and found.get("val") and found["train"] != found["val"]:
        odd = sorted(set(found["train"]) ^ set(found["val"]))
        raise UserError(
            f"the train and val data hold different classes (e.g. {odd[0]!r} in only one): "
            "give both the same class folders"
        )


def precheck_data(cfg) -> None:
    """The data errors that show without opening the data sets: each `data.<split>._target_` that has a `precheck`
    (data.shapes, ImageFiles, ShardDataset, cifar10 do) is called with the node's plain arguments and returns the
    class names it will find, or None. A data set of your own gets the same early refusal by giving it one."""
    found = {}
    for split in ("train", "val"):
        node = cfg.data.get(split)
        if not OmegaConf.is_dict(node) or "_target_" not in node:
            continue
        arguments(OmegaConf.to_container(node, resolve=False), f"data.{split}.")  # before precheck(**) is called
        precheck = getattr(_locate(node._target_), "precheck", None)
        if precheck is None:
            continue
        args = OmegaConf.to_container(node, resolve=True)
        args = {k: v for k, v in args.items() if k != "_target_" and not (isinstance(v, dict) and "_target_" in v)}
        found[split] = precheck(**args)
    check_classes(found, cfg.data.get("num_classes"))


def precheck_resume(cfg, run_dir: Path) -> None:
    """A resume that train() would refuse, refused now: no file there, not a checkpoint, another run's config
    (unless resume_strict=false), another model, a number of processes that does not divide its global batch. The
    checkpoint is memory-mapped: its tensors are not read."""
    from . import checkpoint, resume  # they import this module

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    found = resume.locate(cfg.resume, run_dir, cfg, world_size, is_main=False)  # the logging is train()'s to do
    if found is None:
        return
    ckpt = checkpoint.load(found, mmap=True)
    resume.compare(ckpt, cfg, found, is_main=False)
    with torch.random.fork_rng(devices=[]):
        model = instantiate(cfg.model)
    resume.check_fits(ckpt, cfg, model, world_size)


class CheckBeforeRun(Callback):
    """`hydra.callbacks` in conf/config.yaml: the checks a run can make before Hydra creates the run folder or writes
    anything, so a refused command leaves nothing behind: `check()` (every key, and the dry step: data, model, task,
    checkpoint monitor), then the device, the data sets' `precheck` and a resume's checkpoint.

    Hydra writes `.hydra/config.yaml` and the log file into the run folder before it calls the task function,
    so a refusal from inside train() would already have overwritten a resumed run's saved config. This runs
    first (single runs; a multirun's jobs are checked by train() itself) and exits with the one-line error.
    Only for train.py: eval.py composes the same config with keys of its own.
    """

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        if config.hydra.job.name != "train":
            return
        # Hydra calls on_run_start before run_job, and only run_job sets HydraConfig, which the `${hydra:...}` parts of
        # hydra.run.dir need (hydra-ecosystem/hydra#1301; run-level callbacks run first, #1884): set it first, as
        # run_job does, or the folder cannot be resolved, and Hydra turns the error into a UserWarning and skips this
        # check (callbacks.py's _notify).
        # Resolved on Hydra's own config, not a copy: `${now:...}` is cached per config object, so run_job names the
        # same folder a second later.
        HydraConfig.instance().set_config(config)
        run_dir = os.path.abspath(str(OmegaConf.select(config, "hydra.run.dir")))
        config = config.copy()
        with read_write(config.hydra.runtime):  # as run_job sets it next, so `${hydra:runtime.output_dir}` resolves
            config.hydra.runtime.output_dir = run_dir
        HydraConfig.instance().set_config(config)
        task = config.copy()
        with open_dict(task):
            del task["hydra"]
        try:
            check(task, config.hydra.runtime.choices, list(config.hydra.overrides.task), dry=False)
            before_work(task, Path(run_dir))  # what shows without building anything: no data drawn for a refusal
            check(task, config.hydra.runtime.choices, list(config.hydra.overrides.task))  # then the dry step
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)


def before_work(cfg, run_dir: Path) -> None:
    """The refusals train() would make once it runs that need no data set opened and no worker started."""
    from .dry_step import run_device  # it imports this module

    job_ranks()  # N SLURM tasks that cannot meet
    run_device(cfg)  # device=cuda with no GPU visible
    precheck_data(cfg)
    if cfg.resume:
        precheck_resume(cfg, run_dir)


def check_command_line(argv: list[str], config_dir) -> None:
    """Compose once before Hydra does, so that what Hydra reports over several lines and exit code 1 (a mistyped key
    without `+`, a value of the wrong type, an unknown group option, a syntax error) is one `error:` line and exit
    code 2 like every other refusal. Commands with Hydra's own options (`-m`, `--cfg`, `--help`...) are left to it."""
    if any(arg.startswith("-") for arg in argv):
        return
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    def composed(overrides, hydra_keys: bool = False):
        with initialize_config_dir(str(Path(config_dir).resolve()), version_base="1.3", job_name="train"):
            return compose("config", overrides=overrides, return_hydra_config=hydra_keys)

    try:
        composed(argv)
    except (HydraException, OmegaConfBaseException) as e:
        print(f"error: {composition_error(e, argv, composed)}", file=sys.stderr)
        sys.exit(2)


def composition_error(e: BaseException, argv: list[str], composed: Callable) -> str:
    """Hydra's composition error in one line; for an unknown key, the nearest known one."""
    typo = re.match(r"Could not override '([^']+)'", str(e))
    if typo:
        key = typo[1]
        parent, _, name = key.rpartition(".")
        try:
            rest = composed([a for a in argv if not a.startswith(key + "=")], hydra_keys=True)
            node = OmegaConf.select(rest, parent) if parent else rest
            known = list(node) if OmegaConf.is_dict(node) else []
        except Exception:  # the other overrides fail too: no suggestion, the error still says which key
            known = []
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {parent + '.' if parent else ''}{close[0]}?)" if close else ""
        where = "Hydra's own config" if key.startswith("hydra.") else "the schema in config.py"
        return f"unknown config key {key}{hint}: {where} has no such key"
    options = getattr(e, "options", None)
    missing = getattr(e, "missing_cfg_file", None)
    if options and missing and "/" in missing:
        group, _, choice = missing.rpartition("/")
        return f"{group}={choice}: there is no conf/{missing}.yaml; choose one of {', '.join(sorted(options))}"
    if type(e).__name__ == "OverrideParseException":
        return f"cannot read the command line: {str(e).splitlines()[0]} (see Hydra's override grammar)"
    merging = re.match(r"Error merging override (\S+)$", str(e))
    if merging and e.__cause__ is not None:  # a value of the wrong type: the override, then OmegaConf's reason
        return f"{merging[1]}: {str(e.__cause__).splitlines()[0]}"
    noise = ("full_key:", "object_type=", "reference_type=", "Config search path", "provider=", "See https://")
    parts = []
    for err in (e, e.__cause__):
        lines = [line.strip() for line in str(err or "").splitlines()]
        parts.append(" ".join(line for line in lines if line and not line.startswith(noise)))
    return ": ".join(part for part in parts if part)[:400]
