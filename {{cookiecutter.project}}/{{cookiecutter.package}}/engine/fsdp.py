"""`parallel=fsdp`: the model's parameters, gradients and optimizer state sharded over the ranks with FSDP2
(`torch.distributed.fsdp.fully_shard`), for a model that no longer fits one device with DDP's full copy per rank.

Every instance of a class in `parallel.shard_modules` becomes its own FSDP unit (its parameters gathered for its
forward and backward only), then the root takes what is left. The optimizer is built on the sharded parameters, so
its state is sharded too. Sharded checkpoints are in checkpoint.py.

No rank ever holds the whole model (`build`): it is built on the meta device (shapes, no memory), sharded, and each
rank allocates its slices (`to_empty`). Then `initialize` fills them one unit at a time: the unit's own tensors are
made whole on the CPU, initialised by the model's own initialiser from a generator seeded by the run's seed and the
unit's name, and each rank keeps its slice. So the same seed gives the same weights on any number of ranks, and at
most one unit is ever whole in memory, on the CPU, never on a device.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import resource
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from hydra.utils import get_class
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from . import distributed
from .checkpoint import SafeLoadPlanner
from .errors import UserError, reason
from .optim import state_slots

log = logging.getLogger("train")
MiB = 2**20


def unit_paths(model: nn.Module, parallel_cfg) -> list[str]:
    """The qualified names of the modules that become FSDP units, innermost first (fully_shard wants a child before
    its parent), the root ("") last: every instance of the classes `parallel.shard_modules` names by import path, or
    when it is null of the model's own `shard_modules` attribute (model=vit: its encoder blocks), else none."""
    names = parallel_cfg.get("shard_modules")
    classes = []
    for name in getattr(model, "shard_modules", []) if names is None else names:
        found = None
        with contextlib.suppress(Exception):
            found = get_class(name)
        if found is None or not issubclass(found, nn.Module):  # get_class returns a class or raises
            raise UserError(
                f"parallel.shard_modules: {name!r} is not an importable torch.nn.Module class: give its import path, "
                "e.g. torchvision.models.vision_transformer.EncoderBlock or a block of your own model"
            )
        if not any(isinstance(m, found) for path, m in model.named_modules() if path):
            raise UserError(
                f"parallel.shard_modules: {name} names nothing in {type(model).__name__}: list a class the model "
                "is built of, or [] to shard the root only"
            )
        classes.append(found)
    return [path for path, m in model.named_modules() if path and isinstance(m, tuple(classes))][::-1] + [""]


def shard(model: nn.Module, parallel_cfg, amp: torch.dtype | None, device) -> nn.Module:
    """`model` (on the meta device) sharded in place, units then root; this rank's slices allocated on `device`.
    amp=bf16: bf16 weights for the compute, float32 gradient reduction and master weights."""
    if amp not in (None, torch.bfloat16):
        raise UserError("parallel=fsdp trains in float32 or with amp=bf16: set amp=bf16 or amp=off")
    mixed = MixedPrecisionPolicy(param_dtype=amp, reduce_dtype=None if amp is None else torch.float32)
    reshard = parallel_cfg.get("reshard_after_forward", True)
    for path in unit_paths(model, parallel_cfg):
        fully_shard(model.get_submodule(path), mp_policy=mixed, reshard_after_forward=reshard)
    return model.to_empty(device=device)


def on_meta(make: Callable[[], nn.Module], channels_last: bool = False) -> nn.Module:
    """The model `make` builds, on the meta device: its shapes and structure, no memory and no random draws."""
    with torch.device("meta"):
        model = make()
    return model.to(memory_format=torch.channels_last) if channels_last else model


def build(make, parallel_cfg, amp: torch.dtype | None, device, seed: int, channels_last: bool = False, like=None):
    """The model `make` builds, sharded without ever being whole (this module's docstring tells how); with `like`, a
    model sharded like it holding a copy of its slices instead (the EMA's: FSDP modules refuse deepcopy)."""
    model = shard(on_meta(make, channels_last), parallel_cfg, amp, device)
    if like is not None:  # built on the meta device: it draws nothing from the run's generators
        with torch.no_grad():
            for (_, mine), (_, theirs) in zip(tensors(model, recurse=True), tensors(like, recurse=True), strict=True):
                mine.copy_(theirs)
        return model
    blueprint = on_meta(make, channels_last)  # a second one, free on the meta device: each unit made whole in turn
    initialize(blueprint, parallel_cfg, seed, model)
    return model


def tensors(module: nn.Module, recurse: bool = False):
    """The module's (name, tensor) pairs, parameters then buffers: its own alone unless `recurse`."""
    return itertools.chain(module.named_parameters(recurse=recurse), module.named_buffers(recurse=recurse))


def initialize(blueprint: nn.Module, parallel_cfg, seed: int, into=None) -> None:
    """The units' tensors initialised one unit at a time (this module's docstring), as a constructor would: each
    module's `reset_parameters()`, children first, then the model's own `init_weights()` when it has one (timm's and
    torchtitan's models do), whose draws into the other units' meta tensors touch nothing. Each tensor goes into
    the sharded model `into` (`put`; None: only check); a tensor nothing set is refused in one line."""
    init_weights = getattr(blueprint, "init_weights", None)
    paths = unit_paths(blueprint, parallel_cfg)
    units: dict[str, list] = {path: [] for path in paths}
    for name, module in blueprint.named_modules():  # parents before children, each in the first unit holding it
        units[next(p for p in paths if not p or name == p or name.startswith(p + "."))].append((name, module))
    for path, modules in units.items():
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            for _, module in modules:
                module.to_empty(device="cpu", recurse=False)
                for _, t in tensors(module):
                    if (mark := not_set(t)) is not None:
                        t.fill_(mark)  # a value no initialiser leaves: what is still so after them was not set
            # from the run's seed and the unit's name: the same on every rank and world size
            torch.manual_seed(int.from_bytes(hashlib.sha256(f"{seed}:{path}".encode()).digest()[:8], "little"))
            for _, module in reversed(modules):
                if callable(getattr(module, "reset_parameters", None)):
                    module.reset_parameters()
            if callable(init_weights):
                try:
                    init_weights()
                except Exception as e:
                    raise UserError(
                        f"parallel=fsdp: {type(blueprint).__name__}.init_weights() fails on the model built on the "
                        f"meta device: {reason(e)}; it is called with no arguments and must set tensors in place "
                        "(docs/distributed.md)"
                    ) from None
        for name, module in modules:
            for key, t in tensors(module):
                mark, full = not_set(t), f"{name}.{key}" if name else key
                if mark is not None and (t.isnan().any() if t.is_floating_point() else (t == mark).all()):
                    raise UserError(
                        f"parallel=fsdp: {full} ({type(module).__name__}) is not set by any initialiser: the model is "
                        f"built on the meta device, where its constructor's initialisation never runs: give "
                        f"{type(module).__name__} a reset_parameters(), or the model an init_weights() that sets it "
                        "(docs/distributed.md)"
                    )
                if into is not None:
                    put(into, full, t)
            module.to_empty(device="meta", recurse=False)


def not_set(t: torch.Tensor) -> float | int | None:
    """The mark of a tensor no initialiser has set: NaN for floats, the least integer for integers, else None."""
    if t.is_floating_point():
        return float("nan")
    return torch.iinfo(t.dtype).min if t.dtype != torch.bool and not t.is_complex() else None


def put(model: nn.Module, name: str, whole: torch.Tensor) -> None:
    """The whole tensor `whole` into the model's tensor `name`: a sharded one keeps only this rank's slice."""
    owner, _, key = name.rpartition(".")
    live = getattr(model.get_submodule(owner), key)
    with torch.no_grad():
        if isinstance(live, DTensor):  # each rank cuts its own slice of the same whole tensor: no communication
            whole = distribute_tensor(whole.to(live.device), live.device_mesh, live.placements, src_data_rank=None)
        live.copy_(whole)


def fill(model: nn.Module, path: Path, fitting: dict) -> None:
    """`init_from` into the sharded model, no rank reading it whole: from a sharded save each rank reads its own
    slices (DCP reshards), from a whole file (memory-mapped) each rank copies its slice, one tensor at a time."""
    if not path.is_dir():
        for name, whole in fitting.items():
            put(model, name, whole)
        return
    live = {k: v for k, v in get_model_state_dict(model).items() if k in fitting}
    dcp.load({"model": live}, checkpoint_id=path, planner=SafeLoadPlanner())
    set_model_state_dict(model, live, options=StateDictOptions(strict=False))


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def no_gradient_sync(model: nn.Module):
    """Within an accumulation window: the micro-batches' gradients add up locally, reduce-scattered on its last."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def peak_rss_mib() -> float:
    """This process's peak resident memory so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class PeakMemory:
    """What each rank holds of the model in the run's log, planned (`plan`) and measured at the first log line and at
    the end: the growth of the peak resident memory since before the model was built, on CUDA the device's peak."""

    def __init__(self, world):
        self.world, self.before, self.planned, self.told = world, peak_rss_mib(), 0.0, False

    def plan(self, model: nn.Module, optimizer: torch.optim.Optimizer, ema: bool) -> PeakMemory:
        """Itself, once the log has the plan: parameters, gradients, optimizer state and the EMA's copy when on."""
        local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
        params = sum(p.numel() * p.element_size() for p in local) / MiB
        whole = sum(p.numel() * p.element_size() for p in model.parameters()) / MiB
        slots = state_slots(optimizer)
        self.planned = (2 + slots + ema) * params
        if self.world.is_main:
            log.info(
                f"fsdp: per rank of {self.world.world_size}: parameters {params:.1f} MiB, gradients {params:.1f} MiB, "
                f"optimizer state {slots * params:.1f} MiB ({slots} per parameter)"
                + (f", EMA {params:.1f} MiB" if ema else "")
                + f"; {self.planned:.1f} MiB in all ({whole:.1f} MiB of parameters unsharded), "
                "besides the loader's batches in flight and the activations"
            )
        return self

    def on_log(self, run, figures: dict) -> None:
        if not self.told:
            self.told = True
            self.tell(run, "so far")

    def on_run_end(self, run) -> None:
        self.tell(run, "over the run")

    def tell(self, run, when: str) -> None:
        on_device = torch.cuda.max_memory_allocated(run.device) / MiB if run.device.type == "cuda" else None
        every = distributed.gather_all((peak_rss_mib(), self.before, on_device), self.world)
        if not self.world.is_main:
            return
        line = (
            f"fsdp: measured peak per rank {when}: resident {', '.join(f'{peak:.0f}' for peak, _, _ in every)} MiB, "
            f"{', '.join(f'{peak - before:.0f}' for peak, before, _ in every)} MiB more than before the model was built"
        )
        if on_device is not None:
            line += f"; tensors on the device {', '.join(f'{d:.0f}' for _, _, d in every)} MiB"
        log.info("%s (planned: %.0f MiB of model state per rank)", line, self.planned)
