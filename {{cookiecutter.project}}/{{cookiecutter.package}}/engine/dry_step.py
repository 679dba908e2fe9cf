"""The config check's last part: the model, task and data the run built (run.build_problem), run once on two real
samples, with everything they changed put back.

On the device the run will use, two training samples go through the run's collate, `data.normalize`, `task.loss`
(its return form checked), backward, gradient clipping and the LR schedule, and two validation samples through
`task.metrics`, each stage failing in one line naming its key (`parts.stage`): a normalize that does not fit the
images, a model or task that does not fit the data, an op without a deterministic kernel under `deterministic=true`
or a `checkpoint.monitor` the task does not report stops the command before the run folder is written. No optimizer
step runs: the weights the run starts from are the ones built.
"""

import contextlib
import copy

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.data import default_collate

from . import parts, process, rng
from .checkpoint import misfit
from .data_check import first_samples
from .device import pick_device, to_device
from .errors import UserError
from .optim import clip_gradients
from .schedule import fast_forward
from .task_results import check_loss, check_metrics, report


def dry_step(cfg, problem, ckpt: dict | None = None) -> list[str]:
    """Refuses the run in one line, or returns the ops without a deterministic kernel it runs (deterministic=warn).
    `problem` (run.Problem): what the run built; `ckpt`: the checkpoint a resume continues (resume.precheck passed
    it), whose weights must fit the model built."""
    model, optimizer, task = problem.model, problem.optimizer, problem.task
    # resume_strict=false lets a change of the model or data through resume.precheck
    if ckpt and (odd := misfit(model.state_dict(), ckpt["model"])):
        raise UserError(
            f"resume: the model's parameters differ from the checkpoint's: {odd} (data.num_classes "
            f"{ckpt['config']['data'].get('num_classes')} there, {cfg.data.get('num_classes')} here): resume with "
            "the same model and data"
        )
    device, target, unexact = pick_device(cfg.device), cfg.task._target_, []
    kernels = Kernels(unexact) if cfg.deterministic is not False else contextlib.nullcontext()  # true or warn

    def named(method: str, split: str):  # an error inside the task or model: one line naming where
        return parts.one_line(f"task {target}: {method}() fails on 2 {split} samples with model {cfg.model._target_}")

    with undone(model, optimizer):
        batch = two_prepared(cfg.data, problem, device, "training")
        transform = parts.batch_transform(cfg.data)
        if transform is not None:
            with parts.stage("data.batch_transform", cfg.data.batch_transform, "on 2 training samples"):
                batch = transform(batch)
        with named("loss", "training"), kernels:
            loss, _ = check_loss(task.loss(model.train(), batch), target)  # a bare loss, or (loss, parts)
            loss.backward()
            clip_gradients(model, cfg.optim.get("grad_clip"), optimizer, torch.amp.GradScaler(enabled=False))
            fast_forward(parts.schedule(cfg.schedule, optimizer, 100), 1)
        batch = two_prepared(cfg.data, problem, device, "validation")
        with torch.no_grad(), named("metrics", "validation"), kernels:
            metrics = task.metrics(model.eval(), batch)
            names = check_metrics(metrics, target, hasattr(task, "compute"))
        if unexact and cfg.deterministic is True:
            raise UserError(
                f"deterministic=true but {unexact[0]} (in {cfg.model._target_} on {device.type}) has no deterministic "
                "kernel: use another op, or set deterministic=warn to run it anyway (the run is then not bit-exact, "
                "and says so)"
            )
        if hasattr(task, "compute"):  # the names reported are those compute() gives, as validation will have them
            totals = {k: torch.as_tensor(metrics[k]).detach().double().cpu() for k in names}
            with named("compute", "validation"):
                names = list(report(task, totals, target))
    reported = ["train_loss"] + [f"val_{name}" for name in names if name != "count"]
    if cfg.checkpoint.monitor not in reported:
        raise UserError(
            f"checkpoint.monitor={cfg.checkpoint.monitor} is not reported by task {target}: "
            f"pick one of {', '.join(reported)}"
        )
    return unexact


@contextlib.contextmanager
def undone(model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    """What a throwaway step changes, put back as it ends: the buffers (BatchNorm's statistics), the gradients (None),
    the optimizer's group settings (a schedule sets lr), training mode, and every generator (`rng.kept`)."""
    buffers = [b.detach().clone() for b in model.buffers()]
    groups = [dict(group) for group in optimizer.param_groups]
    try:
        with rng.kept():
            yield
    finally:
        with torch.no_grad():
            for live, kept in zip(model.buffers(), buffers, strict=True):
                live.copy_(kept)
        model.zero_grad(set_to_none=True)
        for group, kept in zip(optimizer.param_groups, groups, strict=True):
            group.clear()
            group.update(kept)
        model.train()


class Kernels(TorchFunctionMode):
    """Around a stage of the dry step (with `deterministic` true or warn), each torch function called in it: torch's
    deterministic mode refuses an op without a deterministic kernel, so the op runs again without the mode and is
    named in `unexact` (by the function called: `put_`, or `backward` for a kernel of the backward pass); an op that
    fails both ways raises its first error."""

    def __init__(self, unexact: list[str]):
        super().__init__()
        self.unexact = unexact

    def __enter__(self):
        self.was = torch.are_deterministic_algorithms_enabled()
        self.warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
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


def two_prepared(data, problem, device: torch.device, split: str):
    """A batch of two samples of `split` prepared as the run prepares its batches (`problem.collate`, then
    `problem.prepare` on `device`), each stage in `parts.stage`; `data`: the run's data config."""
    name = "train" if split == "training" else "val"
    # from a shallow copy: a data set that opens its files on first use does so on the copy, not for the workers
    dataset = copy.copy(getattr(problem, f"{name}_set"))
    samples = first_samples(dataset, f"data.{name}")

    def stage(key: str):  # the collate, then each stage of `prepare` (data.normalize...)
        return parts.stage(key, data.get(key.removeprefix("data.")), f"on 2 {split} samples")

    with stage(f"data.{name}" if getattr(dataset, "collate_fn", None) is not None else "data.collate"):
        batch = (problem.collate or default_collate)(samples)
    return problem.prepare(to_device(batch, device, non_blocking=False), stage)
