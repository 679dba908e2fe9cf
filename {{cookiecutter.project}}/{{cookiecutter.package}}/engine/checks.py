"""The config checks that build nothing: every key known and in range, required values set, every `_target_`
importable and given only arguments it takes, and what the data sets can tell without being opened (`precheck`).
Each refusal is one line (UserError) naming the key; the dry step (dry_step.py) then builds and runs what the run
will build, and preflight.py runs both once per command.
"""

import dataclasses
import difflib
import importlib
import inspect
import re
from collections.abc import Callable
from enum import Enum

from hydra.errors import InstantiationException
from omegaconf import MISSING, DictConfig, OmegaConf

{% if cookiecutter.with_tracking == "yes" %}
from . import tracking
{% endif %}
from .errors import UserError
from .optim import LOOP_KEYS
from .schema import LOOP_OPEN_KEYS, OPEN_KEYS, PACKAGE, REQUIRED_OPEN, SHIPPED, Config


def check_keys(cfg: DictConfig, choices: dict | None = None, overrides: list[str] | None = None) -> None:
    """Refuse a bad config in one line (UserError), before any work. `choices`/`overrides` (Hydra's) make the
    message for a missing value name the file and the command."""
    missing(cfg, choices or {}, overrides or [])
    try:
        OmegaConf.to_container(cfg, resolve=True)
    except Exception as e:  # an interpolation to a key that is not there, a bad resolver
        raise UserError(f"config: {str(e).splitlines()[0]}") from None
    unknown(cfg, Config, "")
    ranges(cfg, Config, "")
{% if cookiecutter.with_tracking == "yes" %}
    tracking.chosen(cfg)  # a logger whose package is missing: the line names the extra to install
{% endif %}
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
    raw["optim"] = {k: v for k, v in raw["optim"].items() if k not in LOOP_KEYS}  # the loop's, not the optimizer's
    for group in ("data", "model", "optim", "task", "schedule"):
        arguments(raw[group], f"{group}.")
    for name, node in (raw.get("callbacks") or {}).items():
        if not (isinstance(node, dict) and isinstance(node.get("_target_"), str)):
            raise UserError(f"callbacks.{name} has no _target_: give it one, e.g. +callbacks.{name}._target_=<class>")
        arguments(node, f"callbacks.{name}.")


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
            raise UserError(f"unknown config key {prefix}{name}{hint}: the schema in schema.py has no such key")
        sub = _schema_of(known[name])
        if sub is not None:
            unknown(cfg[name], sub, f"{prefix}{name}.")


def _schema_of(f: dataclasses.Field):
    """The dataclass of a nested group field (loader, schedule, ...), else None."""
    factory = f.default_factory
    return factory if factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory) else None


# data.* keys the loop reads itself (run.py), besides the data sets' own `${data.<key>}` values
LOOP_DATA_KEYS = ("num_classes", "normalize", "collate", "batch_transform", "on_bad_sample", "input"{% if cookiecutter.with_streams == "yes" %}, "stream_resume"{% endif %})


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
            locate(tree["_target_"])
        except Exception as e:
            raise UserError(f"{prefix}_target_={tree['_target_']} cannot be imported: {reason(e)}") from None
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
            parameters = inspect.signature(locate(target)).parameters.values()
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


def locate(path: str):
    """The object a dotted `_target_` path names, as Hydra's instantiate finds it: the longest importable module
    prefix, then attributes. An ImportError or AttributeError says why not."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as e:
            if e.name is None or not path.startswith(e.name):  # a module that exists failed to import something
                raise
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(f"no module named {parts[0]!r}")


def reason(e: BaseException) -> str:
    """The error a `_target_` raised, without Hydra's wrapping, in one line. Only Hydra's wrapper is unwrapped: another
    error's cause (PIL's struct.error under "image file is truncated") says less than the error itself."""
    inner = e.__cause__ if isinstance(e, InstantiationException) and e.__cause__ is not None else e
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
    (data.shapes, ImageFiles, {% if cookiecutter.with_shards == "yes" %}ShardDataset, {% endif %}cifar10 do) is called with the node's plain arguments and returns the
    class names it will find, or None. A data set of your own gets the same early refusal by giving it one."""
    found = {}
    for split in ("train", "val"):
        node = cfg.data.get(split)
        if not OmegaConf.is_dict(node) or "_target_" not in node:
            continue
        arguments(OmegaConf.to_container(node, resolve=False), f"data.{split}.")  # before precheck(**) is called
        precheck = getattr(locate(node._target_), "precheck", None)
        if precheck is None:
            continue
        args = OmegaConf.to_container(node, resolve=True)
        args = {k: v for k, v in args.items() if k != "_target_" and not (isinstance(v, dict) and "_target_" in v)}
        found[split] = precheck(**args)
    check_classes(found, cfg.data.get("num_classes"))
