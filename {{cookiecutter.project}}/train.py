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

# OpenMP reads its wait policy once, as torch loads: process.omp_wait_policy from the command line (else passive, as
# in conf/config.yaml) unless the environment has one; null is no policy OpenMP knows: its default
os.environ.setdefault(
    "OMP_WAIT_POLICY", dict(a.split("=", 1) for a in sys.argv if "=" in a).get("process.omp_wait_policy", "passive")
)

import hydra
import torch
from hydra.core.hydra_config import HydraConfig

from {{ cookiecutter.package }}.engine import {% if cookiecutter.with_fsdp == "yes" %}distributed, fsdp, {% endif %}preflight, process, schema
from {{ cookiecutter.package }}.engine.epoch_meter import EpochMeter
from {{ cookiecutter.package }}.engine.errors import UserError, find_user_error, in_your_code
from {{ cookiecutter.package }}.engine.failures import worker_death
from {{ cookiecutter.package }}.engine.optim import clip_gradients
from {{ cookiecutter.package }}.engine.preempt import StopRequest
from {{ cookiecutter.package }}.engine.run import Run, build
from {{ cookiecutter.package }}.engine.task_results import split_loss
from {{ cookiecutter.package }}.engine.validation import evaluate

log = logging.getLogger("train")


def train(cfg, checked: tuple) -> tuple[int, float]:
    """The run, once its checks passed; `checked`: what they found (a resume's checkpoint, ops run inexactly)."""
    hydra_cfg = HydraConfig.get()
    stop = StopRequest()
    # the stop signals' handlers until train() leaves, installed before workers fork (they inherit a flag setter);
    # however train() leaves, exceptions included, `cleanup` closes what it opened, then the handlers go
    with stop.installed(), contextlib.ExitStack() as cleanup:
        run = build(cfg, Path(hydra_cfg.runtime.output_dir), stop, cleanup, checked)
        run.callbacks.call("on_run_start", run)  # conf/callbacks: a sample grid, early stopping... (callbacks.py)
        stopping = False  # a signal or a callback asked to stop, and every rank agreed to stop at the same step
        while not stopping and not run.finished():
            run.model.train()
            meter = run.epoch_meter()  # loss sums on the device (a resume's carried in); waits, samples on the host
            for batch in meter.timed(run.train_batches()):
                boundary = run.window_ends()  # the accumulation window's last micro-batch: the optimizer steps
                drawn = run.train_loader.drawn  # the samples collated into this batch, counted by the loader
                meter.add(*train_step(run, batch, boundary), drawn, step=run.step if boundary else run.step + 1)
                stopping = boundary and step_end(run, meter)  # logs, stops, saves and validations: optimizer steps
                if stopping or (run.at_max_steps() and not run.train_loader.at_epoch_end):
                    break  # mid-epoch: no validation; the checkpoint holds the position in the epoch and its sums
            else:
                stopping = validate(run, meter)  # the epoch's end, a stop asked read there too: save, best.pth
        run.callbacks.call("on_run_end", run)
        closing = run.closing_line() if run.world.is_main else None
        if closing:
            log.info(closing)
    best = run.checkpoints.best.value
    if stopping:
        stop.hand_over()  # e.g. a job runner requeues the job now that the checkpoint is on disk
    return stop.exit_code if stopping else 0, best if best is not None else float("nan")


def train_step(run: Run, batch, boundary: bool) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    """Forward and backward of one micro-batch; on the last of its accumulation window (`boundary`), the optimizer
    step. Returns the loss, the gradient norm before clipping (optim.grad_clip, else None) and the loss's parts
    (a task's `(loss, parts)`, else {}), all still on the device."""
    with run.no_sync(not boundary), torch.autocast(run.device.type, dtype=run.amp, enabled=run.amp is not None):
        loss, parts = split_loss(run.task.loss(run.net, batch))
        run.scaler.scale(loss / run.cfg.accumulate_steps).backward()  # DDP all-reduces on the window's last only
    parts = {name: part.detach() for name, part in parts.items()}
    if not boundary:
        return loss.detach(), None, parts
    grad_norm = clip_gradients(run.model, run.cfg.optim.grad_clip, run.optimizer, run.scaler)
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    run.scheduler.step()
{% if cookiecutter.with_fsdp == "yes" %}
    if fsdp.is_sharded(run.model):  # rank 0's buffers (BatchNorm statistics) on every rank, as DDP has them: FSDP
        distributed.main_buffers(run.model, run.world)  # leaves each its own; a sharded checkpoint keeps one copy
{% endif %}
    if run.ema is not None:
        run.ema.update()
    run.step += 1
    return loss.detach(), grad_norm, parts


def step_end(run: Run, meter: EpochMeter) -> bool:
    """What an optimizer step ends with: its log line, a health sample, then (off an epoch's end) a mid-epoch
    validation or a save; True when every rank stops after this step, mid-epoch. An epoch's end is `validate`'s to
    judge: it reads a stop asked as well."""
    # One process acts on a signal at the next step (the flag is a Python bool, no device read);
    # ranks agree on it where they read the loss anyway, so all stop after the same step.
    stopping = run.stop.requested and not run.world.distributed
    # the loss read to the host (each read waits for the device) at log lines, saves among them, only
    if stopping or run.log_line_due() or run.at_max_steps():
        stopping = log_step(run, meter)  # a non-finite loss stops here, before anything is saved
    run.monitor.step(run.step, meter.data_wait, meter.started)  # health every monitor.every_steps
    if run.train_loader.at_epoch_end:
        return False
    if run.validation_due():  # val_every_steps: validate mid-epoch and save with its record
        return validate(run, meter, epoch_end=False) or stopping
    if stopping or run.at_max_steps() or run.checkpoints.due(run.step):
        run.checkpoints.save(run)
    return stopping


def log_step(run: Run, meter: EpochMeter) -> bool:
    """A log point: one host read of the window's sums, a steps.jsonl line; True when a rank was asked to stop. A stop
    off the interval writes no line and keeps the window, so a resumed run's lines are those of a run that never
    stopped."""
    figures, first_bad, signalled = meter.read_window(run.stop.requested, run.world, keep=not run.log_line_due())
    if first_bad:
        raise UserError(run.checkpoints.diverged(first_bad, run.step))
    if run.log_line_due():
        run.runlog.step(run.step, run.scheduler.get_last_lr()[0], figures)
        run.callbacks.call("on_log", run, figures)
    return signalled


def validate(run: Run, meter: EpochMeter, epoch_end: bool = True) -> bool:
    """Validate, log the record (metrics.jsonl, TensorBoard), hand it to the callbacks and save with it (best.pth
    when it is the best so far); True when a rank was asked to stop meanwhile, or a callback asked to. At an epoch's
    end it closes the epoch; mid-epoch (val_every_steps) the train loader and the RNG are left as they are, so the run
    goes on exactly as without it."""
    train_time, faults = meter.training_time()  # before validation
    if epoch_end and run.train_loader.epoch < run.cfg.epochs:  # persistent workers queue the next epoch meanwhile
        run.train_loader.start_next_epoch()
    val = evaluate(run.task, run.evaluated, run.val_loader, run.device, run.world, run.prepare)  # one host read
    run.model.train()  # evaluate() put it in eval mode; a mid-epoch validation goes back to training
    train_loss, rate, signalled = meter.read_epoch(train_time, run.stop.requested, run.world)
    record = {
        "epoch": run.train_loader.epoch - 1 if epoch_end else run.train_loader.epoch,
        "step": run.step,
        "train_loss": train_loss,
        **{f"val_{name}": value for name, value in val.items() if name != "count"},
        "lr": run.scheduler.get_last_lr()[0],
        "samples_per_s": rate,
        "data_wait_s": meter.data_wait,
        "epoch_time_s": train_time,
        "worker_pids": sorted(run.train_loader.worker_pids),
    }
    if epoch_end:  # worker_count, rss_mib, pss_mib, fds, data_wait_share, page_faults_per_batch
        record.update(run.monitor.epoch(meter.data_wait, train_time, faults))
    else:
        record["mid_epoch"] = True
    run.runlog.epoch(record)
    figures = " ".join(f"{k} {v:.4f}" for k, v in record.items() if k == "train_loss" or k.startswith("val_"))
    log.info("epoch %d step %d %s %.0f samples/s data_wait %.2fs", record["epoch"], run.step, figures, rate,
             meter.data_wait)  # fmt: skip
    asked = run.callbacks.validation_end(run, record)  # e.g. early stopping; before the save that keeps its state
    if epoch_end:
        run.meter = None  # the epoch's sums are in its record: the checkpoint carries none
    run.checkpoints.save(run, record)
    return signalled or asked


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg) -> float:
    """Returns the best checkpoint.monitor value of the run: what a sweeper (Optuna) optimizes."""
    try:
        checked = preflight.check(cfg)  # every key and a dry step, before any work; then the run's .hydra/ record
        # threads, the allocator's thresholds, deterministic kernels (engine/process.py); after the checks, whose
        # refusal leaves the folder of a run it would go on byte for byte (setup writes a log line)
        process.setup(cfg)
        code, best = train(cfg, checked)
    except Exception as e:
        # a killed worker: its pid and signal, not a traceback; your code's exception: its traceback, then the line
        error = find_user_error(e) or worker_death(e) or in_your_code(e, "training")
        if error is None:
            raise
        code = getattr(error, "exit_code", 2)  # 2: bad input, 1: your code; a loader failure's own code
        if code not in (1, 2) or os.environ.get("RANK", "0") == "0":  # every rank fails alike there: rank 0 says it
            print(f"{getattr(error, 'trace', '')}error: {error}", file=sys.stderr)
        sys.exit(code)
    if code:
        sys.exit(code)
    return best


if __name__ == "__main__":
    schema.register()  # the schema Hydra checks conf/config.yaml against
    preflight.one_line_errors(main)  # a typo: one line, not a report
