"""The config check's last part: build what the run will build and run it once on two real samples.

On the device the run will use, two training samples go through the run's collate, `data.normalize`, `task.loss`
(its return form checked) and backward, and two validation samples through `task.metrics`, each stage failing in
one line naming its key (`parts.stage`): a wrong argument, a missing data path, a normalize that does not fit the
images, a model or task that does not fit the data, an op without a deterministic kernel under `deterministic=true`
or a `checkpoint.monitor` the task does not report stops the command before the run folder is written.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.data import default_collate

from . import {% if cookiecutter.with_fsdp == "yes" %}fsdp, {% endif %}parts, process, rng
from .callbacks import Callbacks
from .checkpoint import init_weights, misfit
from .data_check import check_classes, first_samples
from .device import {% if cookiecutter.with_fsdp == "yes" %}amp_dtype, {% endif %}pick_device, to_device
from .errors import UserError
from .optim import clip_gradients
from .schedule import fast_forward
from .task_results import check_loss, check_metrics, report

HOST_READS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__")  # values, not shapes


def dry_step(cfg, ckpt: dict | None = None) -> list[str]:
    """Refuses the run in one line, or returns the ops without a deterministic kernel it runs (deterministic=warn).
    `ckpt`: the checkpoint a resume continues (resume.precheck passed it), whose weights must fit the model built."""
    device = pick_device(cfg.device)
    unexact: list[str] = []
    with rng.kept():
{% if cookiecutter.with_fsdp == "yes" %}
        meta = cfg.parallel.strategy == "fsdp"  # the model on the meta device: forms and shapes, no whole model
        if meta:  # a shard class naming nothing in the model, amp=fp16, a tensor no initialiser sets: refused here
            model = fsdp.on_meta(lambda: parts.model(cfg), cfg.channels_last)
            fsdp.initialize(model, cfg.parallel, cfg.seed)
            fsdp.policy(amp_dtype(cfg.amp, device))
        else:
            model = parts.model(cfg, device)  # model, optimizer and task first: they cost less than the data
        if cfg.init_from and not ckpt:  # a misfit is refused here, before the run folder is written
            init_weights(model, cfg.init_from, cfg.init_strict, quiet=True, load=(lambda _: None) if meta else None)
{% else %}
        model = parts.model(cfg, device)  # model, optimizer and task first: they cost less than the data
        if cfg.init_from and not ckpt:  # a misfit is refused here, before the run folder is written
            init_weights(model, cfg.init_from, cfg.init_strict, quiet=True)
{% endif %}
        odd = misfit(model.state_dict(), ckpt["model"]) if ckpt else ""
        if odd:  # resume_strict=false lets a change of the model or data through resume.precheck
            raise UserError(
                f"resume: the model's parameters differ from the checkpoint's: {odd} (data.num_classes "
                f"{ckpt['config']['data'].get('num_classes')} there, {cfg.data.get('num_classes')} here): resume with "
                "the same model and data"
            )
        optimizer = parts.optimizer(cfg, model)
        task = parts.task(cfg)
        Callbacks(cfg)  # each built once: a bad argument or value is refused before the run folder is written
        train_set, val_set = parts.data_set(cfg, "train"), parts.data_set(cfg, "val")
        classes = {"train": getattr(train_set, "classes", None), "val": getattr(val_set, "classes", None)}
        check_classes(classes, cfg.data.get("num_classes"))
        collate = parts.collate(cfg, train_set)
        with parts.stage(cfg, "data.normalize", "to build"):
            prepare = parts.prepare(cfg, device)
{% if cookiecutter.with_fsdp == "yes" %}
        target, where = cfg.task._target_, torch.device("meta") if meta else device
        batch = to_device(two_prepared(cfg, train_set, collate, prepare, device, "training"), where)
{% else %}
        target = cfg.task._target_
        batch = two_prepared(cfg, train_set, collate, prepare, device, "training")
{% endif %}
        transform = parts.batch_transform(cfg)
        if transform is not None:
            with parts.stage(cfg, "data.batch_transform", "on 2 training samples"):
                batch = transform(batch)
        with _named(cfg, target, "loss", "training"), Kernels(cfg.deterministic, unexact{% if cookiecutter.with_fsdp == "yes" %}, meta{% endif %}):
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
            fast_forward(parts.schedule(cfg, optimizer, 100), 1)
{% if cookiecutter.with_fsdp == "yes" %}
        batch = to_device(two_prepared(cfg, val_set, collate, prepare, device, "validation"), where)
        names = None  # stays None when an op of the model or task has no meta kernel: the run's first step checks
{% else %}
        batch = two_prepared(cfg, val_set, collate, prepare, device, "validation")
{% endif %}
        with torch.no_grad(), _named(cfg, target, "metrics", "validation"), Kernels(cfg.deterministic, unexact{% if cookiecutter.with_fsdp == "yes" %}, meta{% endif %}):
            metrics = task.metrics(model.eval(), batch)
            names = check_metrics(metrics, target, hasattr(task, "compute"))
        if unexact and cfg.deterministic is True:
            raise UserError(
                f"deterministic=true but {unexact[0]} (in {cfg.model._target_} on {device.type}) has no deterministic "
                "kernel: use another op, or set deterministic=warn to run it anyway (the run is then not bit-exact, "
                "and says so)"
            )
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


class Unchecked(Exception):
    """An op that cannot run on meta tensors (a model built on the meta device): the rest of the stage is the
    first step's to check."""


class Kernels(TorchFunctionMode):
    """Around a stage of the dry step, each torch function called in it. With `deterministic` true or warn,
    torch's deterministic mode refuses an op without a deterministic kernel: the op runs again without the
    mode and is named in `unexact` (by the function called: `put_`, or `backward` for a kernel of the backward
    pass); an op that fails both ways raises its first error. With `meta`, an op on meta tensors that has no
    meta kernel (NotImplementedError) or reads values to the host raises Unchecked."""

    def __init__(self, deterministic, unexact: list[str], meta: bool = False):
        super().__init__()
        self.deterministic, self.unexact, self.meta = deterministic is not False, unexact, meta

    def __enter__(self):
        self.was = torch.are_deterministic_algorithms_enabled()
        self.warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
        if self.deterministic:
            process.use_deterministic_kernels()  # the run's (CUBLAS_WORKSPACE_CONFIG among them), before its setup
            torch.use_deterministic_algorithms(True)  # here an op without a deterministic kernel raises
        return super().__enter__()

    def __exit__(self, *exc):
        torch.use_deterministic_algorithms(self.was, warn_only=self.warn_only)
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name, kwargs = getattr(func, "__name__", repr(func)), kwargs or {}
        try:
            return func(*args, **kwargs)
        except Exception as first:
            if self.meta and (isinstance(first, NotImplementedError) or name in HOST_READS):
                raise Unchecked(name) from first
            if not self.deterministic:
                raise
            torch.use_deterministic_algorithms(False)
            try:
                result = func(*args, **kwargs)
            except Exception:
                raise first from None
            finally:
                torch.use_deterministic_algorithms(True)
        if name not in self.unexact:
            self.unexact.append(name)
        return result


@contextlib.contextmanager
def _named(cfg, target: str, method: str, split: str):
    """An error inside the task or model: one line naming where. An op without a meta kernel (a data-dependent
    shape, a host read) on the meta device ends the stage: not checkable here."""
    with parts.one_line(f"task {target}: {method}() fails on 2 {split} samples with model {cfg.model._target_}"):
        with contextlib.suppress(Unchecked):
            yield


def two_prepared(cfg, dataset, collate, prepare, device: torch.device, split: str):
    """A batch of two samples of `split` prepared as the run prepares its batches (`collate`, then `prepare` on
    `device`), each stage in `parts.stage`."""
    name, where = "data.train" if split == "training" else "data.val", f"on 2 {split} samples"
    samples = first_samples(dataset, name)
    with parts.stage(cfg, name if getattr(dataset, "collate_fn", None) is not None else "data.collate", where):
        batch = (collate or default_collate)(samples)
    return prepare(to_device(batch, device, non_blocking=False), lambda key: parts.stage(cfg, key, where))
