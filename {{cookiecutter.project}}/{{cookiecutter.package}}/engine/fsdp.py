"""`parallel=fsdp`: the model's parameters, gradients and optimizer state sharded over the ranks with FSDP2
(`torch.distributed.fsdp.fully_shard`), for a model that no longer fits one device with DDP's full copy per rank.

Every instance of a class in `parallel.shard_modules` becomes its own FSDP unit (its parameters gathered for its
forward and backward only), then the root takes what is left. The optimizer is built on the sharded parameters, so
its state is sharded too. Sharded checkpoints are in sharded_checkpoint.py.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from hydra.utils import get_class, instantiate
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from .errors import UserError

log = logging.getLogger("train")

MIB = 2**20


def shard_classes(names: list[str]) -> tuple[type, ...]:
    """The module classes `parallel.shard_modules` names by import path, each refused in one line when it is none."""
    classes = []
    for name in names:
        try:
            found = get_class(name)
        except Exception:
            found = None
        if not isinstance(found, type) or not issubclass(found, torch.nn.Module):
            raise UserError(
                f"parallel.shard_modules: {name!r} is not an importable torch.nn.Module class: give its import path, "
                "e.g. torchvision.models.vision_transformer.EncoderBlock or a block of your own model"
            )
        classes.append(found)
    return tuple(classes)


def unit_names(parallel_cfg, model: torch.nn.Module) -> list[str]:
    """The shard classes: `parallel.shard_modules`, or when it is null the model's own `shard_modules` attribute
    (model=vit: its encoder blocks), else none (the root alone)."""
    names = parallel_cfg.get("shard_modules")
    if names is None:
        names = getattr(model, "shard_modules", [])
    return list(names)


def units(model: torch.nn.Module, names: list[str]) -> list[torch.nn.Module]:
    """The submodules that become FSDP units, innermost first (fully_shard wants a child before its parent); a named
    class with no instance in the model is refused in one line."""
    classes = shard_classes(names)
    found = [m for m in model.modules() if m is not model and isinstance(m, classes)]
    for name, cls in zip(names, classes):
        if not any(isinstance(m, cls) for m in found):
            raise UserError(
                f"parallel.shard_modules: {name} names nothing in {type(model).__name__}: list a class the model "
                "is built of, or [] to shard the root only"
            )
    return found[::-1]


def policy(amp: torch.dtype | None) -> MixedPrecisionPolicy:
    """amp=bf16 under FSDP: bf16 weights for the compute, float32 gradient reduction and master weights."""
    if amp is None:
        return MixedPrecisionPolicy()
    if amp != torch.bfloat16:
        raise UserError("parallel=fsdp trains in float32 or with amp=bf16: set amp=bf16 or amp=off")
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def shard(model: torch.nn.Module, parallel_cfg, amp: torch.dtype | None) -> torch.nn.Module:
    """`model` sharded in place: each unit, then the root. Every rank must call it on the same, identically initialised
    model (the same seed): each keeps its own slice of every parameter."""
    mixed, reshard = policy(amp), bool(parallel_cfg.get("reshard_after_forward", True))
    for unit in units(model, unit_names(parallel_cfg, model)):
        fully_shard(unit, mp_policy=mixed, reshard_after_forward=reshard)
    fully_shard(model, mp_policy=mixed, reshard_after_forward=reshard)
    return model


def twin(model_cfg, model: torch.nn.Module, parallel_cfg, amp: torch.dtype | None, device) -> torch.nn.Module:
    """A second model sharded like `model`, holding a copy of its weights: the EMA's (FSDP modules refuse deepcopy).
    Built without drawing from the run's generators, so a resumed run draws what the straight one drew."""
    with torch.random.fork_rng(devices=[]):
        copy = instantiate(model_cfg).to(device)
    copy = shard(copy, parallel_cfg, amp)
    with torch.no_grad():
        for mine, theirs in zip(copy.state_dict().values(), model.state_dict().values(), strict=True):
            mine.copy_(theirs)
    return copy


def is_sharded(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def no_gradient_sync(model: torch.nn.Module):
    """Within an accumulation window: the micro-batches' gradients add up locally, reduce-scattered on its last."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def full(norm: torch.Tensor) -> torch.Tensor:
    """A gradient norm as a plain tensor: over DTensor shards clip_grad_norm_ returns a DTensor (a collective)."""
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def local_bytes(tensors) -> int:
    """Bytes this rank holds of `tensors` (its shard of a DTensor)."""
    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


# Per-parameter state tensors the shipped optimizers keep, shaped like the parameter: Adam's two moments, SGD's
# momentum buffer when momentum is on.
def state_slots(optimizer: torch.optim.Optimizer) -> int:
    defaults = optimizer.defaults
    if "betas" in defaults:
        return 2
    return 1 if defaults.get("momentum") else 0


def memory_line(model: torch.nn.Module, optimizer: torch.optim.Optimizer, world_size: int) -> str:
    """What each rank holds of the model: its parameters, their gradients (as large) and the optimizer's state."""
    params = local_bytes(model.parameters())
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    slots = state_slots(optimizer)
    return (
        f"fsdp: per rank of {world_size}: parameters {params / MIB:.1f} MiB, gradients {params / MIB:.1f} MiB, "
        f"optimizer state {slots * params / MIB:.1f} MiB ({slots} per parameter); {whole / MIB:.1f} MiB of "
        "parameters unsharded, besides the loader's batches in flight"
    )
