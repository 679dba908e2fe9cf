"""The run's state as named parts (torchtitan's `states`), and when it is saved.

A checkpoint is the run's parts by name (`snapshot`), plus what describes the save (format, epoch, config,
versions). `load` puts each part back in the order the dict gives: the tensors first, the ranks' loaders and
main RNG last, just before the loop.
{% if cookiecutter.with_fsdp == "yes" %}
A sharded run (parallel=fsdp) has the same parts: its tensor parts (`SHARDED`) are each rank's slices,
which the writer saves as shards and a resume reads back into the live tensors (checkpoint.py).
{% endif %}
The files themselves, written whole and atomically, and read safely: checkpoint.py.
"""

from __future__ import annotations

import logging
{% if cookiecutter.with_fsdp == "yes" %}
from pathlib import Path
{% endif %}

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


def tensors(run) -> dict:
    """The run's tensor parts: the model's, the optimizer's and the EMA's (None without){% if cookiecutter.with_fsdp == "yes" %}; sharded, this rank's
    slices{% endif %}."""
{% if cookiecutter.with_fsdp == "yes" %}
    if fsdp.is_sharded(run.model):
        ema = None if run.ema is None else get_model_state_dict(run.ema.model)
        return {"model": get_model_state_dict(run.model),
                "optimizer": get_optimizer_state_dict(run.model, run.optimizer), "ema": ema}  # fmt: skip
{% endif %}
    ema = None if run.ema is None else run.ema.model.state_dict()
    return {"model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(), "ema": ema}


def snapshot(run) -> dict:
    """The run's checkpoint: every part's state in the order `load` puts them back (collectives among the
    parts, the epoch's running sums and the ranks': every rank calls it), and what describes the save
    (read by a resume's checks and by people)."""
    config = OmegaConf.to_container(run.cfg, resolve=True, enum_to_str=True)
{% if cookiecutter.with_tracking == "yes" %}
    trackers = run.runlog.tracking  # rank 0's; none elsewhere
{% endif %}
    return {
        **tensors(run),
        "scheduler": run.scheduler.state_dict(),
        "scaler": run.scaler.state_dict() if run.scaler.is_enabled() else None,
        "step": run.step,
        "best": run.checkpoints.best.state(),
        "callbacks": run.callbacks.state_dict(),
        # mid-epoch, the epoch's running sums (a collective): the resumed run logs the same figures
        "meter": None if run.meter is None else run.meter.state(run.world),
{% if cookiecutter.with_tracking == "yes" %}
        # the MLflow / W&B run ids a resume continues: read as the trackers start (run.build), before `load`
        "tracking": {t.name: t.run_id for t in trackers.trackers} if trackers is not None else {},
{% endif %}
        # what differs between data-parallel processes: each one's train loader (its worker streams), main RNG
        "ranks": distributed.gather_all(
            {"rng": rng.capture_main(), "loader": run.train_loader.state_dict()}, run.world
        ),
        "format": FORMAT,
        "epoch": run.train_loader.epoch,
        "progress": run.train_loader.progress(),
        "config": config,
        "versions": versions(config),  # torch's and the libraries the config's _target_s come from
        "nondeterministic_ops": list(run.unexact),  # deterministic=warn: why this run is not bit-exact
        "nondeterministic_data": list(run.own_draws),  # a data set's generator of its own (data_check.own_draws)
    }


def load(run, ckpt: dict{% if cookiecutter.with_fsdp == "yes" %}, path: Path{% endif %}) -> None:
    """Every part of the checkpoint `ckpt` back into the live run, in `snapshot`'s order{% if cookiecutter.with_fsdp == "yes" %}; a sharded one's
    tensor parts first read from the shards at `path` into the live tensors they are slices of (a collective){% endif %}.
    A changed run (resume_strict=false): the optimizer groups' settings (lr, weight decay...) are this run's
    config's, and this config plans the schedule from here on; loading the saved schedule would bring back the
    checkpoint's plan (its total steps: `epochs=8` on an `epochs=2` checkpoint would train on at the old
    schedule's floor)."""
    model, optimizer, changed = run.model, run.optimizer, changes(ckpt, run.cfg)
    fresh = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
{% if cookiecutter.with_fsdp == "yes" %}
    sharded = fsdp.is_sharded(model)
    if ckpt.get("sharded"):  # the EMA's when both the save and this run have one
        live = tensors(run)
        both = live["ema"] is not None and ckpt["ema"] is not None
        wanted = [name for name in SHARDED if name != "ema" or both]
        ckpt = {**ckpt, **fill(path, {name: live[name] for name in wanted})}

    def weights(module, saved) -> None:  # a model's tensors by name (sharded: this rank's slices)
        if sharded:
            set_model_state_dict(module, saved)
        else:
            module.load_state_dict(saved)

    weights(model, ckpt["model"])
    if sharded:  # by parameter name: the grouping does not matter
        set_optimizer_state_dict(model, optimizer, ckpt["optimizer"])
    else:
        regroup(ckpt["optimizer"], ckpt, model, optimizer)
{% else %}
    model.load_state_dict(ckpt["model"])
    regroup(ckpt["optimizer"], ckpt, model, optimizer)
{% endif %}
    if changed:
        for group, ours in zip(optimizer.param_groups, fresh, strict=True):
            group.update(ours)
    # after the model: a checkpoint without EMA weights starts the average from the model's
    if run.ema is not None:
        if ckpt.get("ema") is None:
            log.warning("resume: the checkpoint has no EMA weights; the average starts from its model weights")
{% if cookiecutter.with_fsdp == "yes" %}
        weights(run.ema.model, ckpt.get("ema") or model.state_dict())
{% else %}
        run.ema.model.load_state_dict(ckpt.get("ema") or model.state_dict())
{% endif %}
    if changed:
        fast_forward(run.scheduler, ckpt["step"])
    else:
        run.scheduler.load_state_dict(ckpt["scheduler"])
    if run.scaler.is_enabled() and ckpt.get("scaler") is not None:  # fp16's loss scale (float32, bf16: none)
        run.scaler.load_state_dict(ckpt["scaler"])
    run.step = ckpt["step"]
    run.checkpoints.best.load(ckpt.get("best"))
    run.callbacks.load_state_dict(ckpt.get("callbacks") or {}, run.cfg.resume_strict)
    run.carried = ckpt.get("meter")  # mid-epoch, the epoch's running sums: the same figures logged
    load_ranks(ckpt["ranks"], run)


def regroup(saved: dict, ckpt: dict, model, optimizer) -> None:
    """`saved` (an optimizer's state_dict) into `optimizer`, each parameter's state found by the grouping the
    checkpoint's config made of this model: parameters grouped otherwise (resume_strict=false with other
    `optim.param_groups`) get their state (momentum, Adam's moments) carried over to where they are now."""
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
