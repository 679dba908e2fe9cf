"""The parts of a run, built from its config in one place: the model (init_from's weights: `init_weights`), the
data sets, their collate, the batches' preparation (data.input, {% if cookiecutter.with_photos == "yes" %}data.decode, {% endif %}data.normalize), the optimizer and the
LR schedule, each from its own config node (not the whole config: a part reads only its keys); the task and
callbacks through `build`.

train.py's run (run.py), the dry step{% if cookiecutter.with_doctor == "yes" %}, eval.py and the doctor{% else %} and eval.py{% endif %} all build through these functions, so a class of
yours is built the same way everywhere, and a failure to build it is the same one line naming its key.
"""

import contextlib
import inspect
import logging
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from . import checkpoint{% if cookiecutter.with_fsdp == "yes" %}, fsdp{% endif +%}
from .device import PrepareBatch, input_transform
from .errors import UserError, in_your_code, reason
from .optim import parameter_groups
from .schema import LOOP_KEYS

log = logging.getLogger(__name__)


@contextlib.contextmanager
def one_line(what: str):
    """Anything raised inside stops the command in one line, `what` and the error's first line; one raised in the
    user's own code (a model, task, data set, collate) with its traceback first (errors.CodeError, exit 1); a
    UserError (also one a data set raised through Hydra: a missing folder) as it is."""
    try:
        yield
    except UserError:
        raise
    except Exception as e:
        cause = e.__cause__ if isinstance(e.__cause__, UserError) else None
        raise cause or in_your_code(e, what) or UserError(f"{what}: {reason(e)}") from None


def stage(key: str, node, where: str):
    """One stage of preparing the batches (or the model), its failure one line naming `key` with `node`, its value in
    this run's config: with its `_target_` (`data.collate (text.pad_batch)`), its value (`channels_last=true`), or as
    not set (the default)."""
    if OmegaConf.is_dict(node):
        key = f"{key} ({node.get('_target_')})"
    elif node is None:
        key = f"{key} (not set)"
    else:
        key = f"{key}={str(node).lower() if isinstance(node, bool) else node}"
    return one_line(f"{key} fails {where}")


def build(node, key: str, *args):
    """`node` (a Hydra `_target_`) built, and called with `args` if any (a `_partial_` one)."""
    with one_line(f"{key}: cannot build {node._target_}"):
        built = instantiate(node)
        return built(*args) if args else built


def model(node, device: torch.device | None = None, channels_last: bool = False) -> torch.nn.Module:
    """`model` (its config `node`): on the CPU as its class makes it, or on `device`, channels-last when
    `channels_last` is on."""
    built = build(node, "model")
    if not isinstance(built, torch.nn.Module):
        raise UserError(f"model: {node._target_} built a {type(built).__name__}, not a torch.nn.Module")
    if device is None:
        return built
    built = built.to(device)
    if channels_last:
        with stage("channels_last", True, f"on model {node._target_}"):
            built = built.to(memory_format=torch.channels_last)
    return built


def data_set(data, split: str):
{% if cookiecutter.with_streams == "yes" %}
    """The data set of `data.<split>` (train, val, or another node of the data config)."""
    return build(data[split], f"data.{split}")
{% else %}
    """The data set of `data.<split>` (train, val, or another node of the data config): an indexed one, since a
    data set read in order (torch's IterableDataset) is not one this project trains or evaluates on."""
    built = build(data[split], f"data.{split}")
    if isinstance(built, torch.utils.data.IterableDataset):
        raise UserError(
            f"data.{split}: {type(built).__name__} is an IterableDataset, read in order: streams are not part of this "
            "project (generated with with_streams=no): give a map-style data set (__len__ and __getitem__)"
        )
    return built
{% endif %}


def collate(data, dataset):
    """The loaders' collate for `dataset`: `data.collate` built; else the one `dataset` names as its `collate_fn`{% if cookiecutter.with_photos == "yes" %} (as
    data.decode=gpu's do); else None, torch's default_collate. Both at once: refused, only you know which fits."""
{% else %};
    else None, torch's default_collate. Both at once: refused, only you know which the samples are made for."""
{% endif %}
    node, own = data.get("collate"), getattr(dataset, "collate_fn", None)
    if node is not None and own is not None:
        raise UserError(
{% if cookiecutter.with_photos == "yes" %}
            f"data.collate is set, and {type(dataset).__name__} collates its batches itself (data.decode=gpu: a "
            "batch's JPEG files kept as a list, decoded on the device): drop data.collate, or keep it with "
            "data.decode=auto"
{% else %}
            f"data.collate is set, and {type(dataset).__name__} collates its batches itself (its collate_fn): "
            "drop one of the two"
{% endif %}
        )
    return own if own is not None or node is None else build(node, "data.collate")


def prepare(data, device: torch.device, channels_last: bool) -> PrepareBatch:
    """What turns a batch on `device` into the model's input, from the `data` config: data.input,{% if cookiecutter.with_photos == "yes" %} data.decode,{% endif +%}
    data.normalize (uint8 images to normalized floats)."""
    with stage("data.normalize", data.get("normalize"), "to build"):
        return input_transform(data, device, channels_last)


def batch_transform(data):
    """`data.batch_transform` (MixUp, CutMix: training batches only, after `prepare`), or None."""
    node = data.get("batch_transform")
    return None if node is None else build(node, "data.batch_transform")


def optimizer(optim, net: torch.nn.Module) -> torch.optim.Optimizer:
    """`optim` over `net`'s parameters in their groups (optim.parameter_groups), built without the loop's keys."""
    node = {k: v for k, v in OmegaConf.to_container(optim, resolve=True).items() if k not in LOOP_KEYS}
    return build(OmegaConf.create(node), "optim", parameter_groups(net, optim))


{% if cookiecutter.with_streams == "yes" %}
def schedule(node, optim: torch.optim.Optimizer, total_steps: int | None):
    """`schedule` over `total_steps` optimizer steps (None: a stream whose length shows as it ends)."""
{% else %}
def schedule(node, optim: torch.optim.Optimizer, total_steps: int):
    """`schedule` over `total_steps` optimizer steps."""
{% endif %}
    # never over max_steps: a run stopped there and resumed must see the lr of the run that never stopped
    factory = build(node, "schedule")
    try:  # not when the schedule has a length of its own
        takes_total = node.get("total_steps") is None and "total_steps" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        takes_total = False
{% if cookiecutter.with_streams == "yes" %}
    if takes_total and total_steps is None:
        raise UserError(
            f"schedule {node._target_} spans the run's steps, and a stream without sizes has no known "
            "epoch length: set schedule.total_steps, give the data set `sizes`, or use schedule=constant"
        )
{% endif %}
    with one_line(f"schedule: cannot build {node._target_}"):  # an argument it does not take: named here
        return factory(optim, **({"total_steps": total_steps} if takes_total else {}))


def init_weights(model: torch.nn.Module, path: str, strict: bool) -> None:
    """`init_from=PATH`: the weights in `path` and nothing else (fine-tuning, not resuming: optimizer, schedule, step,
    loader and RNG start fresh). PATH is a local checkpoint of this project (its `model`, not `ema`) or a `state_dict`
    file (or a dict with one under `state_dict`), memory-mapped. With `strict=False` (init_strict=false), only the
    tensors whose name and shape fit, and a line listing the rest.{% if cookiecutter.with_fsdp == "yes" %} A sharded model (parallel=fsdp) takes them
    through fsdp.fill, no rank reading them whole; any other gathers a sharded checkpoint whole.{% endif %}"""
    who = f"init_from={path}"
    if "://" in path:
        raise UserError(f"{who}: only local files are read; download it first and give its path")
{% if cookiecutter.with_fsdp == "yes" %}
    local, sharded = Path(path).expanduser(), fsdp.is_sharded(model)
    saved = checkpoint.read(local, who, "a checkpoint or a state_dict file", mmap=True, whole=not sharded)
{% else %}
    saved = checkpoint.read(Path(path).expanduser(), who, "a checkpoint or a state_dict file", mmap=True)
{% endif %}
    for key in ("model", "state_dict"):  # this project's checkpoints; Lightning's and others' state_dict files
        if isinstance(saved, dict) and isinstance(saved.get(key), dict):
            saved = saved[key]
            break
    if not isinstance(saved, dict) or not saved or not all(isinstance(v, torch.Tensor) for v in saved.values()):
        raise UserError(f"{who}: holds no state_dict (a dict of tensors, or one under 'model')")
    saved = {k.removeprefix("module."): v for k, v in saved.items()}  # DDP-wrapped saves name keys module.*
    own = model.state_dict()
    listing = checkpoint.misfit(own, saved)
    if strict and listing:
        raise UserError(f"{who} does not fit the model: {listing}; set init_strict=false to load what fits "
                        "(e.g. a new head)")  # fmt: skip
    fitting = {k: v for k, v in saved.items() if k in own and v.shape == own[k].shape}
{% if cookiecutter.with_fsdp == "yes" %}
    if sharded:
        fsdp.fill(model, local, fitting)
    else:
        model.load_state_dict(fitting, strict=False)
{% else %}
    model.load_state_dict(fitting, strict=False)
{% endif %}
    left = f"; left as initialised: {listing}" if fitting.keys() != own.keys() else ""
    log.info("init_from=%s: loaded %d of %d tensors (weights only; a fresh optimizer, schedule and step count: "
             "not a resume)%s", path, len(fitting), len(own), left)  # fmt: skip
