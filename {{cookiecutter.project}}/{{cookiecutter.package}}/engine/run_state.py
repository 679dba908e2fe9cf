"""The run's state as named parts (torchtitan's `states`), and when it is saved.

A checkpoint is `{name: part.state_dict()}` for the parts `parts(run)` names, plus what describes the
save (format, epoch, config, versions: `description`). Each part saves itself and loads itself back
(`load`), in the order the dict gives: the tensors first, the ranks' loaders and main RNG last, just
before the loop.
{% if cookiecutter.with_fsdp == "yes" %}
A sharded run (parallel=fsdp) has the same parts: its tensor parts (`SHARDED`) are each rank's slices,
which the writer saves as shards and a resume reads back into the live tensors (checkpoint.py).
{% endif %}
The files themselves, written whole and atomically, and read safely: checkpoint.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
{% if cookiecutter.with_fsdp == "yes" %}
from pathlib import Path
{% endif %}
from typing import NamedTuple

import torch
from omegaconf import OmegaConf
{% if cookiecutter.with_fsdp == "yes" %}
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
{% endif %}

from . import distributed, {% if cookiecutter.with_fsdp == "yes" %}fsdp, {% endif %}rng
from .checkpoint import FORMAT{% if cookiecutter.with_fsdp == "yes" %}, SHARDED, fill{% endif +%}
from .optim import parameter_groups
from .resume import changes, versions
from .schedule import fast_forward

log = logging.getLogger(__name__)


class Part(NamedTuple):
    """One named part of the run's state: `state_dict()` is what a checkpoint keeps of it;
    `load_state_dict(saved, ckpt)` puts it back (`ckpt`: the whole checkpoint, for a part whose loading
    depends on how the run was saved)."""

    state_dict: Callable[[], object]
    load_state_dict: Callable[[object, dict], None]


def parts(run) -> dict[str, Part]:
    """The run's state by name, in the order a resume loads it. Some parts are collectives (the ranks'
    loaders, the epoch's running sums): every rank asks for all of them."""
{% if cookiecutter.with_fsdp == "yes" %}
    sharded = fsdp.is_sharded(run.model)
{% endif %}
    return {
        "model": weights(run.model{% if cookiecutter.with_fsdp == "yes" %}, sharded{% endif %}),
        "optimizer": Part(
{% if cookiecutter.with_fsdp == "yes" %}
            lambda: get_optimizer_state_dict(run.model, run.optimizer) if sharded else run.optimizer.state_dict(),
{% else %}
            run.optimizer.state_dict,
{% endif %}
            lambda saved, ckpt: load_optimizer(saved, ckpt, run),
        ),
        # after the model: a checkpoint without EMA weights starts the average from the model's
        "ema": ema_part(run{% if cookiecutter.with_fsdp == "yes" %}, sharded{% endif %}) if run.ema is not None else Part(lambda: None, lambda saved, ckpt: None),
        "scheduler": Part(run.scheduler.state_dict, lambda saved, ckpt: load_schedule(saved, ckpt, run)),
        "scaler": Part(
            lambda: run.scaler.state_dict() if run.scaler.is_enabled() else None,
            lambda saved, ckpt: load_scaler(saved, run.scaler),
        ),
        "step": Part(lambda: run.step, lambda saved, ckpt: setattr(run, "step", saved)),
        "best": Part(run.checkpoints.best.state, lambda saved, ckpt: run.checkpoints.best.load(saved)),
        "callbacks": Part(
            run.callbacks.state_dict,
            lambda saved, ckpt: run.callbacks.load_state_dict(saved or {}, run.cfg.resume_strict),
        ),
        # mid-epoch, the epoch's running sums (a collective): the resumed run logs the same figures
        "meter": Part(
            lambda: None if run.meter is None else run.meter.state(run.world),
            lambda saved, ckpt: setattr(run, "carried", saved),
        ),
{% if cookiecutter.with_tracking == "yes" %}
        # the MLflow / W&B runs a resume continues: read as the trackers start (run.records), before this load
        "tracking": Part(lambda: tracked(run.runlog.tracking), lambda saved, ckpt: None),
{% endif %}
        # what differs between data-parallel processes: each one's train loader (its worker streams), main RNG
        "ranks": Part(
            lambda: distributed.gather_all(own(run), run.world),
            lambda saved, ckpt: load_ranks(saved, run),
        ),
    }


def weights(model: torch.nn.Module{% if cookiecutter.with_fsdp == "yes" %}, sharded: bool{% endif %}) -> Part:
    """A model's tensors by name{% if cookiecutter.with_fsdp == "yes" %} (sharded: this rank's slices){% endif %}."""
{% if cookiecutter.with_fsdp == "yes" %}
    if sharded:
        return Part(lambda: get_model_state_dict(model), lambda saved, ckpt: set_model_state_dict(model, saved))
{% endif %}
    return Part(model.state_dict, lambda saved, ckpt: model.load_state_dict(saved))


def ema_part(run{% if cookiecutter.with_fsdp == "yes" %}, sharded: bool{% endif %}) -> Part:
    """The EMA's weights; a checkpoint without them (ema.decay set on resuming) starts the average from the
    model's."""
    average = weights(run.ema.model{% if cookiecutter.with_fsdp == "yes" %}, sharded{% endif %})

    def load(saved, ckpt) -> None:
        if saved is None:
            log.warning("resume: the checkpoint has no EMA weights; the average starts from its model weights")
            saved = run.model.state_dict()
        average.load_state_dict(saved, ckpt)

    return Part(average.state_dict, load)


def load_scaler(saved: dict | None, scaler: torch.amp.GradScaler) -> None:
    """fp16's loss scale as it was; a run saved without one (float32, bf16) leaves this run's as it starts."""
    if scaler.is_enabled() and saved is not None:
        scaler.load_state_dict(saved)


def own(run) -> dict:
    """This rank's part of `ranks`."""
    return {"rng": rng.capture_main(), "loader": run.train_loader.state_dict()}
{% if cookiecutter.with_tracking == "yes" %}


def tracked(trackers) -> dict:
    """The run ids of the MLflow / W&B runs (rank 0's; none elsewhere)."""
    return {t.name: t.run_id for t in trackers.trackers} if trackers is not None else {}
{% endif %}


def description(run) -> dict:
    """What describes a save rather than a part of the run: read by a resume's checks and by people."""
    config = OmegaConf.to_container(run.cfg, resolve=True, enum_to_str=True)
    return {
        "format": FORMAT,
        "epoch": run.train_loader.epoch,
        "progress": run.train_loader.progress(),
        "config": config,
        "versions": versions(config),  # torch's and the libraries the config's _target_s come from
        "nondeterministic_ops": list(run.unexact),  # deterministic=warn: why this run is not bit-exact
        "nondeterministic_data": list(run.own_draws),  # a data set's generator of its own (data_check.own_draws)
    }


def load(run, ckpt: dict{% if cookiecutter.with_fsdp == "yes" %}, path: Path{% endif %}) -> None:
    """Every part of the checkpoint `ckpt` back into the live run, in order{% if cookiecutter.with_fsdp == "yes" %}; a sharded one's tensor parts
    first read from the shards at `path` into the live tensors they are slices of (a collective){% endif %}."""
    named = parts(run)
{% if cookiecutter.with_fsdp == "yes" %}
    if ckpt.get("sharded"):  # the EMA's when both the save and this run have one
        both = run.ema is not None and ckpt["ema"] is not None
        wanted = [name for name in SHARDED if name != "ema" or both]
        ckpt = {**ckpt, **fill(path, {name: named[name].state_dict() for name in wanted})}
{% endif %}
    for name, part in named.items():
        part.load_state_dict(ckpt.get(name), ckpt)


def load_optimizer(saved: dict, ckpt: dict, run) -> None:
    """The checkpoint's optimizer state. Parameters grouped otherwise (resume_strict=false with other
    `optim.param_groups`): each one's state (momentum, Adam's moments) is carried over to where it is now,
    found through the checkpoint's grouping of this model. A changed run (resume_strict=false): the groups'
    settings (lr, weight decay...) are this run's config's."""
    model, optimizer = run.model, run.optimizer
    fresh = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
{% if cookiecutter.with_fsdp == "yes" %}
    if fsdp.is_sharded(model):  # by parameter name: the grouping does not matter
        set_optimizer_state_dict(model, optimizer, saved)
    else:
        regroup(saved, ckpt, model, optimizer)
{% else %}
    regroup(saved, ckpt, model, optimizer)
{% endif %}
    if changes(ckpt, run.cfg):
        for group, ours in zip(optimizer.param_groups, fresh, strict=True):
            group.update(ours)


def regroup(saved: dict, ckpt: dict, model, optimizer) -> None:
    """`saved` (an optimizer's state_dict) into `optimizer`, each parameter's state found by the grouping the
    checkpoint's config made of this model."""
    then = [p for group in parameter_groups(model, ckpt["config"]["optim"]) for p in group["params"]]
    now = [p for group in optimizer.param_groups for p in group["params"]]
    sizes = [len(group["params"]) for group in optimizer.param_groups]
    if [id(p) for p in then] == [id(p) for p in now] and sizes == [len(g["params"]) for g in saved["param_groups"]]:
        optimizer.load_state_dict(saved)  # the same groups: the state and the groups' settings as saved
        return
    at = {id(p): i for i, p in enumerate(now)}
    state = optimizer.state_dict()
    state["state"] = {at[id(p)]: saved["state"][i] for i, p in enumerate(then) if i in saved["state"] and id(p) in at}
    optimizer.load_state_dict(state)
    log.info(
        "resume: the parameters are grouped otherwise (optim.param_groups): each one's optimizer state is carried "
        "over, and the groups' lr and weight decay are this run's"
    )


def load_schedule(saved: dict, ckpt: dict, run) -> None:
    """The same run: the schedule's state as it was, bit for bit. A changed run (resume_strict=false): this
    run's config plans the schedule from here on; loading the saved state would bring back the checkpoint's
    plan (its total steps: `epochs=8` on an `epochs=2` checkpoint would train on at the old schedule's floor).
    """
    if changes(ckpt, run.cfg):
        fast_forward(run.scheduler, ckpt["step"])
    else:
        run.scheduler.load_state_dict(saved)


def load_ranks(saved: list[dict], run) -> None:
    """Each rank's loader and main RNG as they were, when as many processes wrote the checkpoint. Another
    number: the position in the epoch is global; the per-rank randomness outside the data (dropout, worker
    seeds) cannot be mapped onto other ranks, so it is derived from (seed, rank, step)."""
    loader, strict, rank = run.train_loader, run.cfg.resume_strict, run.world.rank
    if len(saved) == loader.world_size:
        loader.load_state_dict(saved[rank]["loader"], strict=strict)
        rng.restore_main(saved[rank]["rng"])
        return
    if loader.rng_mode == "per_worker" and rank == 0:
        log.warning(
            "resume: rng_mode=per_worker on %d processes instead of %d: the workers' RNG streams start afresh "
            "(from seed, rank and step), so the augmentations differ from the run that never stopped; "
            "rng_mode=per_sample keeps them", loader.world_size, len(saved),
        )  # fmt: skip
    combined = loader.combined([state["loader"] for state in saved])
    loader.load_state_dict(combined, strict=strict, reseed=rng.derived(run.cfg.seed, rank, run.step, 1))
    rng.seed_everything(rng.derived(run.cfg.seed, rank, run.step, 0))


def snapshot(run) -> dict:
    """The run's checkpoint: every part's state (collectives among the parts: every rank calls it), and what
    describes the save."""
    return {**{name: part.state_dict() for name, part in parts(run).items()}, **description(run)}
