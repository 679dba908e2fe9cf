"""The config check's last part: build what the run will build and run it once on two real samples.

The data sets, model, optimizer and task of the config are built, a batch of two training samples goes through
`data.collate`, the device, `data.normalize`, `task.loss` (its return form checked) and backward on the device
the run will use, and a batch of two validation samples through `task.metrics`. Each stage of preparing a batch
fails in one line naming its key (`stage`). So a wrong argument, a data path that does not exist, a normalize that
does not fit the images, a model that does not fit the data, a task that does not fit the batches, an op without a
deterministic kernel under `deterministic=true`, or a `checkpoint.monitor` the task does not report stops the
command in one line before the run folder is written. Under `deterministic=warn` the ops without a deterministic
kernel are let through and returned, for the run to name once. All RNG (python, numpy, torch) is left as it was.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import warnings

import numpy as np
import torch
from omegaconf import OmegaConf
from torch.utils.data import default_collate

from . import {% if cookiecutter.with_fsdp == "yes" %}fsdp, {% endif %}parts{% if cookiecutter.with_streams == "yes" %}, shard_plan{% endif +%}
from .callbacks import Callbacks
from .checkpoint import init_weights
from .device import {% if cookiecutter.with_fsdp == "yes" %}amp_dtype, {% endif %}pick_device, to_device
from .errors import UserError, reason
from .optim import clip_gradients
from .task_results import check_loss, check_metrics, report

NO_KERNEL = " does not have a deterministic implementation"  # the words of torch's error and warning
NONDETERMINISTIC = re.compile(r"(\S+)" + NO_KERNEL)
SPARE = 8  # samples first_samples may pass over when they fail to read


def dry_step(cfg) -> list[str]:
    """Refuses the run in one line, or returns the ops it runs that have no deterministic kernel (only
    `deterministic=warn` lets any through)."""
    device = pick_device(cfg.device)
    unexact: list[str] = []
    with kept_rng():
{% if cookiecutter.with_fsdp == "yes" %}
        meta = cfg.parallel.strategy == "fsdp"  # the model on the meta device: forms and shapes, no whole model
        if meta:  # a shard class naming nothing in the model, amp=fp16, a tensor no initialiser sets: refused here
            model = fsdp.on_meta(lambda: parts.model(cfg), cfg.channels_last)
            fsdp.initialize(model, cfg.parallel, cfg.seed)
            fsdp.policy(amp_dtype(cfg.amp, device))
        else:
            model = parts.model(cfg)  # model, optimizer and task first: they cost less than the data
        if cfg.init_from and not cfg.resume:  # a misfit is refused here, before the run folder is written
            init_weights(model, cfg.init_from, cfg.init_strict, quiet=True, load=(lambda _: None) if meta else None)
{% else %}
        model = parts.model(cfg)  # model, optimizer and task first: they cost less than the data
        if cfg.init_from and not cfg.resume:  # a misfit is refused here, before the run folder is written
            init_weights(model, cfg.init_from, cfg.init_strict, quiet=True)
{% endif %}
        optimizer = parts.optimizer(cfg, model)
        task = parts.task(cfg)
        Callbacks(cfg)  # each built once: a bad argument or value is refused before the run folder is written
        train_set, val_set = parts.data_sets(cfg)
        collate = parts.collate(cfg, train_set) or default_collate
        with stage(cfg, "data.normalize", "to build"):
            prepare = parts.prepare(cfg, device)
{% if cookiecutter.with_fsdp == "yes" %}
        if not meta:
            model = placed(cfg, model, device)
        target, where = cfg.task._target_, torch.device("meta") if meta else device
        batch = to_device(two_prepared(cfg, train_set, collate, prepare, device, "training"), where)
{% else %}
        model = placed(cfg, model, device)
        target = cfg.task._target_
        batch = two_prepared(cfg, train_set, collate, prepare, device, "training")
{% endif %}
        transform = parts.batch_transform(cfg)
        if transform is not None:
            with stage(cfg, "data.batch_transform", "on 2 training samples"):
                batch = transform(batch)
        with kernels(cfg.deterministic, device, unexact), _named(cfg, target, "loss", "training"):
            loss, _ = check_loss(task.loss(model.train(), batch), target)  # a bare loss, or (loss, parts)
            loss.backward()
{% if cookiecutter.with_fsdp == "yes" %}
            if not meta:  # under FSDP no rank takes a step on the whole model
                clip_gradients(model, cfg.optim.get("grad_clip"), optimizer, torch.amp.GradScaler(enabled=False))
                optimizer.step()
{% else %}
            clip_gradients(model, cfg.optim.get("grad_clip"), optimizer, torch.amp.GradScaler(enabled=False))
            optimizer.step()
{% endif %}
            with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": not so here
                warnings.simplefilter("ignore", UserWarning)
                parts.schedule(cfg, optimizer, 100).step()
{% if cookiecutter.with_fsdp == "yes" %}
        batch = to_device(two_prepared(cfg, val_set, collate, prepare, device, "validation"), where)
        names = None  # stays None when an op of the model or task has no meta kernel: the run's first step checks
{% else %}
        batch = two_prepared(cfg, val_set, collate, prepare, device, "validation")
{% endif %}
        with torch.no_grad(), kernels(cfg.deterministic, device, unexact), _named(cfg, target, "metrics", "validation"):
            metrics = task.metrics(model.eval(), batch)
            names = check_metrics(metrics, target, hasattr(task, "compute"))
{% if cookiecutter.with_fsdp == "yes" %}
        if names is None:
            return unexact
        if hasattr(task, "compute"):  # the names reported are those compute() gives, as validation will have them
            totals = {k: torch.as_tensor(metrics[k]).detach().double() for k in names}
            totals = {k: torch.ones(v.shape, dtype=v.dtype) if meta else v.cpu() for k, v in totals.items()}
{% else %}
        if hasattr(task, "compute"):  # the names reported are those compute() gives, as validation will have them
            totals = {k: torch.as_tensor(metrics[k]).detach().double().cpu() for k in names}
{% endif %}
            with _named(cfg, target, "compute", "validation"):
                names = list(report(task, totals, target))
    reported = ["train_loss"] + [f"val_{name}" for name in names if name != "count"]
    if cfg.checkpoint.monitor not in reported:
        raise UserError(
            f"checkpoint.monitor={cfg.checkpoint.monitor} is not reported by task {target}: "
            f"pick one of {', '.join(reported)}"
        )
    return unexact


def placed(cfg, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """The model on `device`, channels-last when `channels_last` is on (a model that refuses it: one line)."""
    model = model.to(device)
    if cfg.channels_last:
        with stage(cfg, "channels_last", f"on model {cfg.model._target_}"):
            model = model.to(memory_format=torch.channels_last)
    return model


@contextlib.contextmanager
def kept_rng():
    """Python, numpy and torch RNG (CPU and CUDA) as they were before: the check draws nothing from the run."""
    python, numpy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if torch.cuda.is_initialized() else []):
        try:
            yield
        finally:
            random.setstate(python)
            np.random.set_state(numpy)


@contextlib.contextmanager
def kernels(mode, device: torch.device, unexact: list[str]):
    """With `deterministic=true`, an op without a deterministic kernel raises here instead of warning mid-run; with
    `warn`, it runs and its name is added to `unexact` (torch's own warning about it is left out: the run names it)."""
    if mode is False:
        yield
        return
    before, warn_only = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's deterministic mode needs it
    torch.use_deterministic_algorithms(True, warn_only=mode == "warn")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)
    for w in seen:  # any other warning is shown as it would have been
        op = NONDETERMINISTIC.search(str(w.message))
        if op:
            if op[1] not in unexact:
                unexact.append(op[1])
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


def quiet(unexact: list[str]) -> None:
    """torch's own warning for each of these ops left out from here on: the run has named them once."""
    for op in unexact:
        warnings.filterwarnings("ignore", message=re.escape(op) + NO_KERNEL)


@contextlib.contextmanager
def _named(cfg, target: str, method: str, split: str):
    """An error inside the task or model: one line naming where, and for a missing deterministic kernel, the op."""
    try:
        yield
    except UserError:
        raise
    except Exception as e:
{% if cookiecutter.with_fsdp == "yes" %}
        if cfg.parallel.strategy == "fsdp" and "meta" in str(e).lower():
            return  # an op without a meta kernel (a data-dependent shape, a host read): not checkable here
{% endif %}
        op = NONDETERMINISTIC.search(str(e))
        if op:
            raise UserError(
                f"deterministic=true but {op[1]} (in {cfg.model._target_} on {pick_device(cfg.device).type}) has no "
                "deterministic kernel: use another op, or set deterministic=warn to run it anyway (the run is then "
                "not bit-exact, and says so)"
            ) from None
        raise UserError(
            f"task {target}: {method}() fails on 2 {split} samples with model {cfg.model._target_}: {reason(e)}"
        ) from None


def first_samples(dataset, name: str, count: int = 2) -> list:
    """The first `count` samples of `dataset` (`name`: its key), for a batch through the configured collate (also the
    throwaway step's in run.py, and callbacks.SampleGrid's). A sample that fails to read is passed over while others
    read: one bad file is the training loader's to name or skip (data.on_bad_sample) at its turn, not a refusal here.
    Only when the first `count` + SPARE all fail does this stop, in one line naming the first sample's error."""
    samples, first_error = [], None
{% if cookiecutter.with_streams == "yes" %}
    stream = shard_plan.is_stream(dataset)
    if stream:  # a stream's first records, in its own order
        try:
            samples = shard_plan.first_records(dataset, count)
        except UserError:
            raise
        except Exception as e:
            first_error = e
    for index in range(0 if stream else min(count + SPARE, len(dataset))):
{% else %}
    for index in range(min(count + SPARE, len(dataset))):
{% endif %}
        try:
            samples.append(dataset[index])
        except UserError:
            raise
        except Exception as e:
            first_error = first_error or e
        if len(samples) == count:
            break
    if not samples and first_error is not None:
        source = getattr(dataset, "sample_source", None)
        where = f" (index 0, {source(0)})" if source{% if cookiecutter.with_streams == "yes" %} and not stream{% endif %} else ""
        raise UserError(f"{name}: reading its first samples fails{where}: {reason(first_error)}") from None
    if not samples:
        raise UserError(f"{name} holds no samples: point it at data")
    return samples


def two_prepared(cfg, dataset, collate, prepare, device: torch.device, split: str):
    """A batch of two samples of `split` prepared as the run prepares its batches, each stage in `stage`: its collate
    (data.collate, or the data set's own collate_fn), then on the device data.input, {% if cookiecutter.with_photos == "yes" %}data.decode, {% endif %}data.normalize."""
    name, where = "data.train" if split == "training" else "data.val", f"on 2 {split} samples"
    samples = first_samples(dataset, name)
    with stage(cfg, name if getattr(dataset, "collate_fn", None) is not None else "data.collate", where):
        batch = collate(samples)
    return prepare(to_device(batch, device, non_blocking=False), lambda key: stage(cfg, key, where))


@contextlib.contextmanager
def stage(cfg, key: str, where: str):
    """One stage of preparing the batches (or the model for them), named by the key that sets it: anything it raises
    stops the command in one line naming that key and the error's first line, where a traceback would name neither."""
    try:
        yield
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"{setting(cfg, key)} fails {where}: {reason(e)}") from None


def setting(cfg, key: str) -> str:
{% if cookiecutter.with_photos == "yes" %}
    """`key` as this run sets it: with its `_target_` (`data.collate (text.pad_batch)`), its value (`data.decode=gpu`),
    or as not set (the stage then runs its default: torch's default_collate, the plain Normalize)."""
{% else %}
    """`key` as this run sets it: with its `_target_` (`data.collate (text.pad_batch)`), its value
    (`channels_last=true`), or as not set (the stage then runs its default: torch's default_collate, the plain
    Normalize)."""
{% endif %}
    node = OmegaConf.select(cfg, key, default=None)
    if OmegaConf.is_dict(node):
        return f"{key} ({node.get('_target_')})"
    if node is None:
        return f"{key} (not set)"
    return f"{key}={str(node).lower() if isinstance(node, bool) else node}"
