"""Everything one training run holds, built from the config in the order exactness needs (`build`).

train.py's loop reads and updates a `Run`; a checkpoint is a `Run` written down (checkpoint.CheckpointPolicy), and
a resume builds a fresh `Run` and loads the checkpoint into it before the first step.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from hydra.utils import instantiate
from tqdm import tqdm

from . import checkpoint, config, distributed, failures, memory, resume, rng
from .device import amp_dtype, device_batches, input_transform
from .loader import TrainLoader, eval_loader, resolve_settings
from .monitor import Monitor
from .preempt import StopRequest
from .runlog import RunLog
from .schedule import warmup_cosine

log = logging.getLogger("train")


@dataclass
class Run:
    cfg: object
    run_dir: Path
    overrides: list  # the command's overrides: the closing line repeats them
    world: distributed.World
    device: torch.device
    stop: StopRequest
    task: object  # conf/task: loss(model, batch) and metrics(model, batch)
    train_loader: TrainLoader
    val_loader: object
    prepare: object  # data.normalize on the device, for whole batches
    model: torch.nn.Module  # the plain model: checkpoints, validation
    net: torch.nn.Module  # what the step calls: the model under DDP and torch.compile when on
    optimizer: torch.optim.Optimizer
    scheduler: object
    scaler: torch.amp.GradScaler
    amp: torch.dtype | None  # autocast dtype, None = float32
    step: int  # optimizer steps done, over the whole run
    resumed: bool
    runlog: RunLog
    monitor: Monitor
    checkpoints: checkpoint.CheckpointPolicy

    def finished(self) -> bool:
        """All epochs done, or `max_steps` reached."""
        return self.train_loader.epoch >= self.cfg.epochs or self.at_max_steps()

    def at_max_steps(self) -> bool:
        return self.cfg.max_steps is not None and self.step >= self.cfg.max_steps

    def log_point(self) -> bool:
        """The loss is read to the host (and ranks agree on a stop) only here: each read waits for the device."""
        epoch_end = self.train_loader.position == self.train_loader.batches_per_epoch
        return epoch_end or self.step % self.cfg.log_every_steps == 0 or self.at_max_steps()

    def train_batches(self):
        """This epoch's batches on the device and through `data.normalize`; the first one sets the memory plan."""
        show_bar = self.cfg.progress and sys.stderr.isatty() and self.world.is_main
        batches = device_batches(self.train_loader, self.device, self.cfg.device_prefetch)  # CUDA: copies overlap
        with failures.save_on_failure(self):  # a stall, a bad sample, a full /dev/shm: saved at the last step
            for batch in tqdm(batches, desc=f"epoch {self.train_loader.epoch}", disable=not show_bar, leave=False):
                if self.monitor.plan is None:  # the bytes the loader holds in flight (shapes, dtypes), logged once
                    self.monitor.set_plan(memory.plan(batch, self.train_loader.settings))
                yield self.prepare(batch)

    def closing_line(self) -> str | None:
        """Where the run is, and the command that continues it (rank 0, once a checkpoint is on disk)."""
        if self.checkpoints.last is None:
            return None
        done = self.train_loader.epoch >= self.cfg.epochs
        return resume.where(self.run_dir, self.checkpoints.last, self.step, done, self.overrides, self.world.world_size)


def build(
    cfg, run_dir: Path, overrides: list, device: torch.device, stop: StopRequest, cleanup: contextlib.ExitStack
) -> Run:
    """Join the ranks, seed, find the checkpoint to resume from, build data, loaders, model, optimizer, schedule and
    logs, and load the checkpoint into them. `cleanup` closes what this opens, however the run ends."""
    world = distributed.join(device)  # one process per rank under torchrun; a no-op otherwise
    cleanup.callback(distributed.leave, world)
    if not world.is_main:
        logging.getLogger().setLevel(logging.WARNING)  # rank 0 reports progress; the others speak only of problems
    device = distributed.rank_device(device, world)
    rng.seed_everything(cfg.seed)
    found = resume.locate(cfg.resume, run_dir, cfg, world.world_size, world.is_main) if cfg.resume else None
    ckpt = checkpoint.load(found) if found else None
    if ckpt:
        resume.compare(ckpt, cfg, found, world.is_main)  # a change of the run is refused unless resume_strict=false

    train_set, val_set = instantiate(cfg.data.train), instantiate(cfg.data.val)
    config.check_data(train_set, val_set, cfg.data.get("num_classes"))
    collate = instantiate(cfg.data.collate) if cfg.data.get("collate") is not None else None  # None: default_collate
    settings = resolve_settings(cfg.loader, device.type)
    # before any worker starts: fit the batches in flight to loader.max_prefetch_mib and to the free /dev/shm
    settings, changes = memory.fit_loader(train_set, settings, cfg.loader, collate)
    for change in changes:
        log.warning("loader: %s", change)
    train_loader = TrainLoader(
        train_set,
        settings,
        seed=cfg.seed,
        rng_mode=cfg.rng_mode.value,
        rank=world.rank,
        world_size=world.world_size,
        worker_init=StopRequest.shield_worker,
        collate_fn=collate,
        on_bad_sample=cfg.data.get("on_bad_sample", "error"),
        bad_samples=failures.BadSampleLog(run_dir / failures.BAD_SAMPLES, world.rank),
    )  # built once
    val_loader = eval_loader(
        val_set, settings, world.rank, world.world_size, worker_init=StopRequest.shield_worker, collate_fn=collate
    )
    prepare = input_transform(cfg.data, device, cfg.channels_last)  # uint8 images -> normalized floats, on device
    model = instantiate(cfg.model).to(device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = instantiate(cfg.optim)(model.parameters())
    scheduler = warmup_cosine(optimizer, cfg.epochs * train_loader.batches_per_epoch, **cfg.schedule)
    amp = amp_dtype(cfg.amp, device)  # None: float32
    if amp is None and str(cfg.amp).lower() in ("fp16", "true"):
        log.warning("amp=fp16 needs CUDA: training in float32 (amp=bf16 works on the CPU)")
    scaler = torch.amp.GradScaler(device.type, enabled=amp == torch.float16)  # fp16 only: bf16 needs no scaling
    task = instantiate(cfg.task)  # before restore: whatever it draws from the RNG, a resumed run draws the same
    step = resume.restore(ckpt, cfg, model, optimizer, scheduler, scaler, train_loader, world.rank) if ckpt else 0
    net = distributed.wrap(model, device, world)  # DDP under torchrun: gradients averaged across ranks
    if cfg.compile:
        net = torch.compile(net)  # compiles on the first steps; checkpoints keep the plain model's names
    if ckpt:
        log.info("resumed from step %d (epoch %d, batch %d)", step, train_loader.epoch, train_loader.position)
    best = checkpoint.Best(cfg.checkpoint.monitor, cfg.checkpoint.mode.value, ckpt)  # best epoch so far
    policy = checkpoint.CheckpointPolicy(
        run_dir / "checkpoints", cfg.checkpoint.keep, cfg.checkpoint.every_steps, best, world
    )
    runlog = cleanup.enter_context(RunLog(run_dir, purge_step=step + 1 if ckpt else None, enabled=world.is_main))
    monitor = Monitor(train_loader, runlog, cfg.monitor.every_steps)  # workers, memory, fds, data wait
    return Run(
        cfg, run_dir, overrides, world, device, stop, task, train_loader, val_loader, prepare, model, net,
        optimizer, scheduler, scaler, amp, step, ckpt is not None, runlog, monitor, policy,
    )  # fmt: skip
