"""Train a model on a task: one DataLoader reused every epoch, and a resume that continues the same run.

    python train.py                          # defaults from conf/config.yaml
    python train.py loader=throughput optim=adamw epochs=20
    python train.py resume=latest            # continue the newest run, bit for bit

The problem is the task (conf/task/, {{ cookiecutter.package }}/tasks.py), the data set and the model; the machinery
that runs them lives in {{ cookiecutter.package }}/engine/ (run.py builds everything this loop uses).
"""

import contextlib
import logging
import os
import sys
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig

from {{ cookiecutter.package }}.engine import config, submit
from {{ cookiecutter.package }}.engine.errors import UserError, find_user_error
from {{ cookiecutter.package }}.engine.evaluate import evaluate
from {{ cookiecutter.package }}.engine.monitor import worker_death
from {{ cookiecutter.package }}.engine.preempt import StopRequest
from {{ cookiecutter.package }}.engine.run import Run, build
from {{ cookiecutter.package }}.engine.runlog import EpochMeter

log = logging.getLogger("train")
submit.picklable_modules()  # `-m hydra/launcher=slurm` pickles main() by value, torch.backends.cudnn too: see submit.py


def train(cfg) -> tuple[int, float]:
    hydra_cfg = HydraConfig.get()
    overrides = list(hydra_cfg.overrides.task)
    config.check(cfg, hydra_cfg.runtime.choices, overrides)  # every key and a dry step, before any work
    stop = StopRequest()  # before workers fork: they inherit a handler that only sets a flag
    device = pick_device(cfg.device, cfg.deterministic)
    with contextlib.ExitStack() as cleanup:  # however train() leaves, exceptions included, this closes what it opened
        run = build(cfg, Path(hydra_cfg.runtime.output_dir), overrides, device, stop, cleanup)
        stopping = False  # a signal asked to stop, and every rank agreed to stop at the same step
        while not stopping and not run.finished():
            run.model.train()
            meter = EpochMeter(run.device)  # loss sums on the device; waits and sample counts on the host
            for batch in meter.timed(run.train_batches()):
                loss = train_step(run, batch)
                meter.add(loss, batch)
                # One process acts on a signal at the next step (the flag is a Python bool, no device read);
                # ranks agree on it where they read the loss anyway, so all stop after the same step.
                stopping = stop.requested and not run.world.distributed
                if stopping or run.log_point():
                    mean_loss, stopping = meter.read_window(stop.requested, run.world)
                    run.runlog.step(run.step, mean_loss, run.scheduler.get_last_lr()[0])
                run.monitor.step(run.step, meter.data_wait, meter.started)  # health every monitor.every_steps
                if stopping or run.at_max_steps() or run.checkpoints.due(run.step):
                    run.checkpoints.save(run)
                if stopping or run.at_max_steps():
                    break
            if stopping or run.at_max_steps():
                break  # mid-epoch: no validation; the checkpoint holds the position in the epoch
            record, stopping = validate(run, meter)
            run.checkpoints.save(run, record)  # best.pth too when this epoch is the best so far
        if run.world.is_main and run.closing_line():
            log.info(run.closing_line())
    best = run.checkpoints.best.value
    if stopping:
        stop.hand_over()  # e.g. submitit requeues the SLURM job now that the checkpoint is on disk
        return stop.exit_code, best if best is not None else float("nan")
    return 0, best if best is not None else float("nan")


def train_step(run: Run, batch) -> torch.Tensor:
    """One optimizer step on one batch; the loss comes back still on the device."""
    with torch.autocast(run.device.type, dtype=run.amp, enabled=run.amp is not None):
        loss = run.task.loss(run.net, batch)
    run.optimizer.zero_grad(set_to_none=True)
    run.scaler.scale(loss).backward()
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.scheduler.step()
    run.step += 1
    return loss.detach()


def validate(run: Run, meter: EpochMeter) -> tuple[dict, bool]:
    """The epoch's record (metrics.jsonl, TensorBoard, best.pth) and whether a rank was asked to stop meanwhile."""
    train_time = meter.end_training()
    if run.train_loader.epoch < run.cfg.epochs:  # persistent workers queue the next epoch's first batches meanwhile
        run.train_loader.start_next_epoch()
    val = evaluate(run.task, run.model, run.val_loader, run.device, run.world, run.prepare)  # one host read
    train_loss, rate, signalled = meter.read_epoch(run.stop.requested, run.world)
    record = {
        "epoch": run.train_loader.epoch - 1,
        "step": run.step,
        "train_loss": train_loss,
        **{f"val_{name}": value for name, value in val.items() if name != "count"},
        "lr": run.scheduler.get_last_lr()[0],
        "samples_per_s": rate,
        "data_wait_s": meter.data_wait,
        "epoch_time_s": train_time,
        "worker_pids": sorted(run.train_loader.worker_pids),
        **run.monitor.epoch(meter.data_wait, train_time),  # worker_count, rss_mib, pss_mib, fds, data_wait_share
    }
    run.runlog.epoch(record)
    figures = " ".join(f"{k} {v:.4f}" for k, v in record.items() if k == "train_loss" or k.startswith("val_"))
    log.info(
        "epoch %d step %d %s %.0f samples/s data_wait %.2fs", record["epoch"], run.step, figures, rate, meter.data_wait
    )
    return record, signalled


def pick_device(choice, deterministic: bool) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise UserError("device=cuda but no CUDA device is visible: use device=cpu or device=auto")
    device = torch.device("cuda" if choice != "cpu" and torch.cuda.is_available() else "cpu")
    if deterministic:  # the same inputs give the same bits: what makes an exact resume checkable
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # warn_only: the config check's dry step has already refused, in one line, an op without a deterministic kernel
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
    return device


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg) -> float:
    """Returns the best checkpoint.monitor value of the run: what a sweeper (Optuna) optimizes."""
    try:
        code, best = train(cfg)
    except Exception as e:
        error = find_user_error(e) or worker_death(e)  # a killed worker: its pid and signal, not a traceback
        if error is None:
            raise
        print(f"error: {error}", file=sys.stderr)
        sys.exit(getattr(error, "exit_code", 2))  # 2: bad input; a loader failure's own code (engine/failures.py)
    if code:
        sys.exit(code)
    return best


if __name__ == "__main__":
    config.register()  # the schema Hydra checks conf/config.yaml against
    main()
