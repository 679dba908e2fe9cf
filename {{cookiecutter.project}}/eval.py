"""Evaluate a checkpoint: the task's metrics on the validation split (or another split of the data config).

    python eval.py ckpt=outputs/2026-11-30/14-56-09_train_balanced/checkpoints/best.pth
    python eval.py ckpt=latest                  # the newest last.pth under outputs/, as resume=latest finds it
    python eval.py ckpt=latest split=train      # any split node of the data config (data.train, data.val, ...)
    torchrun --standalone --nproc_per_node=2 eval.py ckpt=... hydra.run.dir=...  # the split shared by 2 processes

The config is composed from the same conf/ as train.py. The `data`, `model` and `task` a run trained with are
stored in its checkpoint and used as they are, and so are its loaders' batch size and worker count; the split is
read by train.py's validation loader (engine/loader.py's eval_loader{% if cookiecutter.with_streams == "yes" %}, indexed data sets and streams alike{% endif %}), so on
the run's number of processes the numbers match the run's own validation exactly. Name a group on the command
line (`data=...`, `data.root=...`, `loader.batch_size=...`) and this command's config is used for it instead.
Prints one line and writes eval.json (`<split>_<name>` for every metric the task reports) into this command's
run folder (rank 0's under torchrun).
"""

import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

# OpenMP reads its wait policy once, as torch loads: process.omp_wait_policy from the command line (else passive, as
# in conf/config.yaml) unless the environment has one; null is no policy OpenMP knows: its default
os.environ.setdefault(
    "OMP_WAIT_POLICY", dict(a.split("=", 1) for a in sys.argv if "=" in a).get("process.omp_wait_policy", "passive")
)

import hydra
import torch
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf, open_dict

from {{ cookiecutter.package }}.engine import checkpoint, distributed, parts, preflight, process, resume, schema
from {{ cookiecutter.package }}.engine.device import pick_device
from {{ cookiecutter.package }}.engine.errors import UserError, find_user_error, in_your_code
from {{ cookiecutter.package }}.engine.loader import eval_loader, resolve_settings
from {{ cookiecutter.package }}.engine.preempt import StopRequest
from {{ cookiecutter.package }}.engine.validation import evaluate

log = logging.getLogger("eval")


@dataclass
class EvalConfig(schema.Config):
    ckpt: Optional[str] = None  # a checkpoint path (relative to where you run), or "latest"
    split: str = "val"  # the node of the data config to evaluate on
    ema: Any = None  # false: the raw weights even when the checkpoint holds EMA weights (which are used otherwise)


# Config sections that decide a checkpoint's numbers: its own copy is used unless the command names them
FROM_CHECKPOINT = ("data", "model", "task")


def evaluate_checkpoint(cfg) -> dict | None:
    """The checkpoint's figures on the split (None on the ranks other than 0 under torchrun: rank 0 reports)."""
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if not cfg.ckpt:
        raise UserError("eval: give ckpt=PATH (a checkpoints/*.pth file) or ckpt=latest")
    # ckpt=latest: train.py's resume=latest rule, held to the keys this command sets (the rest comes from the
    # checkpoint), written by any number of processes
    training = OmegaConf.masked_copy(cfg, [k for k in cfg if k not in ("ckpt", "split", "ema")])
    overrides = [o.lstrip("+~").split("=")[0] for o in HydraConfig.get().overrides.task]  # the keys set
    only = [k for k in overrides if k not in ("ckpt", "split", "ema") and not k.startswith(("checkpoint.", "hydra"))]
    found = resume.locate(cfg.ckpt, run_dir, training, world_size=None, only=only)
    if found is None:
        raise UserError(f"eval: ckpt=latest found no checkpoints/last.pth under {cfg.checkpoint.search_dir!r}")
    # weights_only=True: refuses truncated, foreign or code-carrying files, as train.py's resume= does
    ckpt = checkpoint.load(found, {% if cookiecutter.with_fsdp == "yes" %}whole=True, {% endif %}who="eval", latest="ckpt")
    saved = ckpt["config"]

    named = {k.split(".")[0] for k in overrides}  # the groups set
    with open_dict(cfg):
        for section in FROM_CHECKPOINT:
            if section not in named and section in saved:
                cfg[section] = saved[section]
        if "loader" not in named:  # the batches set how the per-batch sums are rounded: the run's validation's
            ran = ckpt["ranks"][0]["loader"]  # what its loaders used (a resume on other processes changes the batch)
            cfg.loader.batch_size = ran["batch_size"]
            cfg.loader.num_workers = ran["num_workers"]{% if cookiecutter.with_streams == "yes" %}  # a stream's batches are each worker's own records{% endif +%}
    splits = [k for k, v in cfg.data.items() if OmegaConf.is_dict(v) and "_target_" in v]
    if cfg.split not in splits:
        raise UserError(f"eval: split={cfg.split!r} is not a dataset of the data config; it has {', '.join(splits)}")

    device = pick_device(cfg.device)
    model = parts.model(cfg.model)
    use_ema = cfg.ema is not False and ckpt.get("ema") is not None  # the weights the run's validation judged
    weights = ckpt["ema"] if use_ema else ckpt["model"]
    if odd := checkpoint.misfit(model.state_dict(), weights):  # names and shapes, checked before the load
        raise UserError(f"eval: the checkpoint's weights do not fit model {cfg.model._target_} ({odd})")
    model.load_state_dict(weights)

    world = distributed.join(device)  # after the checks above: under torchrun each rank takes a share of the split
    try:
        if not world.is_main:
            logging.getLogger().setLevel(logging.WARNING)  # rank 0 reports; the others speak only of problems
        if world.world_size != resume.written_by(ckpt) and world.is_main:
            log.info(
                "the run validated on %d processes and this evaluation runs on %d: other batches, so the figures "
                "may differ from the run's in their last digits", resume.written_by(ckpt), world.world_size,
            )  # fmt: skip
        model.to(device)
        dataset = parts.data_set(cfg.data, cfg.split)
        collate = parts.collate(cfg.data, dataset)
        settings = resolve_settings(cfg.loader, device.type)
        loader = eval_loader(
            dataset, settings, world.rank, world.world_size, worker_init=StopRequest.shield_worker,
            collate_fn=collate, start_guard=StopRequest.starting_workers,
            seed=saved["seed"] if saved.get("rng_mode") == "per_sample" else None,  # the run's validation's draws
        )  # fmt: skip
        channels_last = cfg.channels_last if "channels_last" in named else saved.get("channels_last", False)
        prepare = parts.prepare(cfg.data, device, channels_last)  # uint8 -> normalized floats, as in training
        if channels_last:
            model = model.to(memory_format=torch.channels_last)
        task = parts.build(cfg.task, "task")
        metrics = evaluate(task, model, loader, device, world, prepare)  # summed over the ranks
    finally:
        distributed.leave(world)
    if not world.is_main:
        return None
    unit = getattr(task, "count_unit", "samples")  # what the task's `count` counts (tasks.py)
    return {
        **{f"{cfg.split}_{name}": value for name, value in metrics.items() if name != "count"},
        "split": cfg.split,
        # read, not asked of the data set{% if cookiecutter.with_streams == "yes" %} (a stream need not know its length){% endif %}; named by what the task counts
        "count": int(metrics["count"]),
        "count_unit": unit,
        **({"samples": int(metrics["count"])} if unit == "samples" else {}),
        "step": ckpt["step"],
        "weights": "ema" if use_ema else "model",
        "checkpoint": str(found),
        "metrics": ckpt.get("metrics"),  # the training run's record of that epoch, when the file is a best.pth
    }


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg) -> None:
    process.setup(cfg)  # deterministic=true: the same kernels as the training run's validation
    preflight.record(cfg, Path(HydraConfig.get().runtime.output_dir) / preflight.HYDRA_FILES)  # as Hydra would
    try:
        result = evaluate_checkpoint(cfg)
    except Exception as e:
        error = find_user_error(e) or in_your_code(e, "eval")  # your code's exception: its traceback, then the line
        if error is None:
            raise
        print(f"{error.trace}error: {error}", file=sys.stderr)
        sys.exit(getattr(error, "exit_code", 2))
    if result is None:
        return
    out = Path(HydraConfig.get().runtime.output_dir) / "eval.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    split = result["split"]
    figures = " ".join(f"{k} {v:.6f}" for k, v in result.items() if k.startswith(f"{split}_"))
    counted = f"{result['count']} {result['count_unit']}"
    print(f"{result['checkpoint']} step {result['step']}: {figures} on {counted} -> {out}")


if __name__ == "__main__":
    schema.register()
    ConfigStore.instance().store(name="schema", node=EvalConfig)  # train.py's schema plus ckpt and split
    main()
