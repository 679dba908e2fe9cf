"""The config schema: each key's type (Hydra refuses `epochs=ten` or `device=gpu` as it composes) and its range
(`preflight.check_keys` refuses `epochs=-1`).

Defaults live in one place, the YAML files under `conf/`: the schema holds no values (every field is MISSING). Adding
a key takes one line here (type and range) and one commented line in the YAML that sets it; a YAML that forgets it
fails with "... has no value". The groups whose keys depend on the chosen `_target_` (data, model, optim, task,
schedule) are open (`group`, `Open`): the schema says which of their keys the loop reads itself, and the range of
the keys the shipped targets give a meaning. `preflight.check_keys` walks this schema once; the engine keeps no
list of the user's keys of its own.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from enum import Enum
from functools import partial
from typing import Any, NamedTuple

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

{% if cookiecutter.with_tracking == "yes" %}
TRACKERS = ("tensorboard", "csv", "mlflow", "wandb")  # logger.use (engine/tracking.py)
{% endif %}
{% if cookiecutter.with_photos == "yes" %}
DECODERS = ("auto", "pil", "torchvision", "gpu")  # data.decode (engine/decode.py)
{% endif %}
SHIPPED = (f"{__name__.split('.')[0]}.", "torch.optim.", "torchvision.")  # this package's targets, torch's optimizers


def flatten(tree: dict, prefix: str = "") -> dict:
    """A config as {dotted key: leaf value} (an empty group a leaf): what a resume compares, a tracker's params."""
    flat = {}
    for name, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{name}."))
        else:
            flat[f"{prefix}{name}"] = value
    return flat


# Checks: each returns None (or False) when the value is fine, else what it should be. A list or dict comes as
# plain Python (preflight.refuse_if).
def number(low: float, high: float = math.inf, above: bool = False, whole=False):
    def check(v):
        bad = isinstance(v, bool) or not isinstance(v, int if whole else (int, float)) or not math.isfinite(v)
        if bad or (v <= low if above else v < low) or v > high:
            span = f"in [{low}, {high}]" if high < math.inf else f"> {low}" if above else f">= {low}"
            return f"{'an integer' if whole else 'a number'} {span}"

    return check


integer = partial(number, whole=True)


def flag(v):
    return None if isinstance(v, bool) else "true or false"


def or_word(check: Callable, *words: str) -> Callable:
    """`check`'s values, or one of the strings `words`."""
    said = " or ".join(f"'{w}'" for w in words)
    return lambda v: v not in words and (wanted := check(v)) and f"{wanted.replace(' or ', ', ')} or {said}"


def or_null(check: Callable, null: str) -> Callable:
    """`check`'s values, or null (`null`: what it means)."""
    return lambda v: v is not None and (wanted := check(v)) and f"{wanted}, or null ({null})"


def text(v):
    if not isinstance(v, str) or not v.strip():
        return "a non-empty string"


def one_of(*allowed) -> Callable:
    """One of the strings `allowed`."""

    def check(v):
        if not (isinstance(v, str) and v in allowed):
            return ", ".join(allowed[:-1]) + f" or {allowed[-1]}"

    return check


def key(check: Callable | None = None) -> Any:
    """A schema field: no default (the YAML holds it), and the range check `check()` applies (None: Hydra's type
    check is all there is, for a bool or an Enum)."""
    return field(default=MISSING, metadata={"check": check})


def choices(name: str, *values: str) -> type[Enum]:
    """A string Enum of `values`, each its own name: Hydra refuses any other value as it composes."""
    return Enum(name, dict(zip(values, values)), module=__name__, type=str)


Device = choices("Device", "auto", "cpu", "cuda")
RngMode = choices("RngMode", "per_sample", "per_worker")
OnBudget = choices("OnBudget", "adjust", "error")  # lower prefetch_factor, then num_workers, until it fits | refuse
BestMode = choices("BestMode", "max", "min")  # higher is better (accuracy) | lower is better (a loss)
WaitPolicy = choices("WaitPolicy", "passive", "active")  # OpenMP threads sleep while they wait | spin
Strategy = choices("Strategy", "ddp"{% if cookiecutter.with_fsdp == "yes" %}, "fsdp"{% endif %})


@dataclass
class LoaderConfig:
    batch_size: int = key(integer(1))
    # `tune`: loader=auto's trials pick the value (engine/loader_tuning.py)
    num_workers: Any = key(or_word(integer(0), "auto", "tune"))
    prefetch_factor: Any = key(or_word(or_null(integer(1), "PyTorch's default, 2"), "tune"))
    pin_memory: Any = key(or_word(flag, "auto", "tune"))
    persistent_workers: Any = key(or_word(flag, "tune"))
    timeout: float = key(number(0))
    max_prefetch_mib: float | None = key(or_null(number(0, above=True), "no budget"))
    on_budget: OnBudget = key()
    ram_budget_mib: float | None = key(or_null(number(0, above=True), "half the memory available at start"))
    cpu_budget: int | None = key(or_null(integer(1), "the usable CPUs split over this node's processes"))
    tune_s: float = key(number(0, above=True))


@dataclass
class EmaConfig:
    decay: float | None = key(or_null(number(0, 1), "off"))


@dataclass
class CheckpointConfig:
    every_steps: int | None = key(or_null(integer(1), "epoch ends only"))
    keep: int = key(integer(0))
    search_dir: str = key(text)
    monitor: str = key(text)  # best.pth keeps the epoch with the best value of this metrics.jsonl key
    mode: BestMode = key()


@dataclass
class MonitorConfig:
    every_steps: int = key(integer(0))


{% if cookiecutter.with_tracking == "yes" %}
@dataclass
class MlflowConfig:
    tracking_uri: str = key(text)
    experiment_name: str | None = key(or_null(text, "the run's name without its time; a sweep's folder in a multirun"))
    on_unreachable: str = key(one_of("error", "local"))  # refuse in one line | the run folder's mlflow.db
    log_checkpoints: bool = key()


@dataclass
class WandbConfig:
    mode: str = key(one_of("online", "offline", "disabled"))  # offline: <run folder>/wandb/, `wandb sync` later
    project: str = key(text)
    entity: str | None = key(or_null(text, "your default entity"))


def loggers(v):
    if not isinstance(v, list) or any(name not in TRACKERS for name in v):
        return f"a list of {', '.join(TRACKERS)}"


@dataclass
class LoggerConfig:
    use: list[str] = key(loggers)
    timeout_s: float = key(number(0, above=True))
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)


{% endif %}
@dataclass
class ProcessConfig:
    omp_wait_policy: WaitPolicy | None = key()
    keep_freed_memory: bool = key()
    threads: int | None = key(or_null(integer(1), "torch's default"))
{% if cookiecutter.with_fsdp == "yes" %}


def class_paths(v):
    if v is not None and (not isinstance(v, list) or not all(isinstance(n, str) and n for n in v)):
        return "null or a list of module class import paths, e.g. [torchvision.models.vision_transformer.EncoderBlock]"
{% endif %}


def callback_nodes(v):
    if not isinstance(v, dict):
        return "a dict of named callback nodes, e.g. 'callbacks=[sample_grid,early_stopping]' (conf/callbacks/)"


@dataclass
class ParallelConfig:
    strategy: Strategy = key()  # ddp: a whole model per rank, gradients all-reduced{% if cookiecutter.with_fsdp == "yes" %}; fsdp: sharded (engine/fsdp.py){% endif +%}
{% if cookiecutter.with_fsdp == "yes" %}
    shard_modules: Any = key(class_paths)  # fsdp: the classes whose instances each become an FSDP unit
    reshard_after_forward: bool = key()  # fsdp: free the gathered weights after each unit's forward
{% endif %}


# An optim.param_groups entry's keys (engine/optim.py): the glob, and what its parameters get instead of optim's
GROUP_KEYS = {
    "match": text,
    "lr_scale": or_null(number(0, above=True), "optim.lr as it is"),
    "weight_decay": or_null(number(0), "optim.weight_decay"),
}


def param_groups(v):
    """optim.param_groups: a list of {match, lr_scale, weight_decay}, `match` required."""
    shape = "a list of {match: <glob over model.named_parameters() names>, lr_scale: <x>, weight_decay: <w>}"
    if not isinstance(v, list):
        return shape
    for i, entry in enumerate(v):
        if not isinstance(entry, dict) or "match" not in entry:
            return f"{shape}: entry {i} has no match"
        for name, value in entry.items():
            wanted = GROUP_KEYS[name](value) if name in GROUP_KEYS else f"one of {', '.join(GROUP_KEYS)}"
            if wanted:
                return f"{shape}: entry {i}'s {name} must be {wanted}"


def batch_part(v):
    """data.input: a position in a tuple batch or a key of a dict batch."""
    position = isinstance(v, int) and not isinstance(v, bool) and v >= 0
    if not position and not (isinstance(v, str) and v.strip()):
        return "a position in the batch (an integer >= 0, 0 for (image, label)) or a dict batch's key (a string)"


class Open(NamedTuple):
    """An open group's keys, which depend on the `_target_` chosen, so Hydra checks none of them:
    - `targets`: where its `_target_`s are, each required; the first is the one `shipped` goes by;
    - `loop`: the keys the loop reads itself: checked whatever the target (None: any value), never handed to it;
    - `shipped`: the keys the shipped targets (SHIPPED) give a meaning: checked when the group's target is one of
      them (a target of yours may mean otherwise)."""

    targets: tuple = ("_target_",)
    loop: dict = {}
    shipped: dict = {}


def group(**spec) -> Any:
    """A schema field of an open group: no default (conf/<group>/ holds it), and its keys as `Open(**spec)`."""
    return field(default=MISSING, metadata={"open": Open(**spec)})


@dataclass
class Config:
    seed: int = key(integer(0, 2**32 - 1))  # numpy's np.random.seed range; torch and python take at least that
    epochs: int = key(integer(1))
    max_steps: int | None = key(or_null(integer(1), "run all epochs"))
    resume: str | None = key(or_null(text, "start fresh"))
    resume_strict: bool = key()
    device: Device = key()
    deterministic: Any = key(or_word(flag, "warn"))  # warn: ops without a deterministic kernel run, named once
    amp: Any = key(one_of("off", "bf16", "fp16"))  # "off" quoted in YAML, where a bare off is false
    channels_last: bool = key()
    compile: bool = key()
    device_prefetch: bool = key()
    log_every_steps: int = key(integer(1))
    progress: bool = key()
    rng_mode: RngMode = key()
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    accumulate_steps: int = key(integer(1))
    init_from: str | None = key(or_null(text, "the model's own initialisation"))
    init_strict: bool = key()
    val_every_steps: int | None = key(or_null(integer(1), "at epoch ends only"))
    ema: EmaConfig = field(default_factory=EmaConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
{% if cookiecutter.with_tracking == "yes" %}
    logger: LoggerConfig = field(default_factory=LoggerConfig)
{% endif %}
    process: ProcessConfig = field(default_factory=ProcessConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    callbacks: Any = key(callback_nodes)  # named callback nodes (conf/callbacks/), each a `_target_`
    data: Any = group(
        targets=("train._target_", "val._target_"),
        loop={  # read by the engine (run.py, parts.py, device.py); the data sets get theirs as `${data.<key>}`
            "num_classes": None,  # the classes the data sets hold are checked against it
            "normalize": None,
            "collate": None,
            "batch_transform": None,
            "on_bad_sample": one_of("error", "skip"),
{% if cookiecutter.with_streams == "yes" %}
            "stream_resume": one_of("exact", "restart_epoch"),  # streams without state (engine/stream_loader.py)
{% endif %}
            "input": batch_part,
        },
        shipped={
            "num_classes": integer(2),
            "image_size": integer(1),
            "per_class": integer(1),
            "root": text,
{% if cookiecutter.with_photos == "yes" %}
            "decode": one_of(*DECODERS),
{% endif %}
        },
    )
    model: Any = group(shipped={"width": integer(1)})
    optim: Any = group(
        loop={  # engine/optim.py's: the optimizer is built without them (LOOP_KEYS)
            "grad_clip": or_null(number(0, above=True), "off"),
            "param_groups": param_groups,
            "decay_norm_and_bias": flag,
        },
        shipped={"lr": number(0, above=True), "weight_decay": number(0), "momentum": number(0, 1)},
    )
    task: Any = group(shipped={"label_smoothing": number(0, 0.999)})
    schedule: Any = group(
        shipped={
            "warmup_steps": integer(0),
            "min_lr_ratio": number(0, 1),
            "total_steps": or_null(integer(1), "the planned epochs' steps"),
        }
    )


OPEN = {f.name: f.metadata["open"] for f in fields(Config) if "open" in f.metadata}  # the open groups, by name
LOOP_KEYS = tuple(OPEN["optim"].loop)  # optim's keys the loop reads: the optimizer never sees them


def register() -> None:
    """The schema, for Hydra to check conf/config.yaml against: called by the entry points before they compose."""
    ConfigStore.instance().store(name="schema", node=Config)


def run_name(*parts) -> str:
    """`${run_name:a,b,...}`: the parts that are set, joined by `_`, safe as one folder name (no `/`, <= 150 chars)."""
    name = "_".join(str(p) for p in parts if p not in (None, "", "null"))
    return name.replace("/", "-")[:150]


# hydra.run.dir / hydra.sweep.subdir use ${run_name:...}. Registered on import rather than in register(): a launcher's
# job that unpickles main() resolves its folder without running train.py's `__main__` block, but it imports this
# module, through the engine modules main's code names.
OmegaConf.register_new_resolver("run_name", run_name, replace=True)
