"""Everything one training run holds, built from the config in the order exactness needs (`build`).

train.py's loop reads and updates a `Run`; a checkpoint is a `Run`'s named parts written down (run_state.py), and
a resume builds a fresh `Run` and loads the checkpoint into it before the first step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from . import checkpoint, distributed, failures, {% if cookiecutter.with_fsdp == "yes" %}fsdp, {% endif %}loader_tuning, memory, parts, resume, rng, run_state{% if cookiecutter.with_tracking == "yes" %}, tracking{% endif +%}
from .batch_transform import SeededBatchTransform
from .callbacks import Callbacks
from .data_check import check_classes
from .device import amp_dtype, device_batches, pick_device
from .dry_step import two_prepared, undone
from .ema import EMA
from .epoch_meter import EpochMeter
from .loader import TrainLoader, eval_loader, resolve_settings
from .monitor import Monitor
from .preempt import StopRequest
from .runlog import RunLog
{% if cookiecutter.with_streams == "yes" %}
from .shard_plan import is_stream
from .stream_loader import StreamLoader
{% endif %}
from .task_results import split_loss

log = logging.getLogger("train")


@dataclass
class Problem:
    """The run's model, optimizer, task, callbacks and data, built once (`build_problem`): the checks' dry step runs
    them on two samples, then the run trains them."""

    model: torch.nn.Module  # the plain model: checkpoints, validation
    optimizer: torch.optim.Optimizer
    task: object  # conf/task: loss(model, batch) and metrics(model, batch)
    callbacks: Callbacks  # the `callbacks` config's, called at the loop's hooks (engine/callbacks.py)
    train_set: object  # data.train as built (not wrapped): what a callback may read samples of
    val_set: object
    collate: object  # the loaders' collate (None: torch's default_collate)
    prepare: object  # data.normalize on the device, for whole batches
{% if cookiecutter.with_fsdp == "yes" %}
    peak: object  # parallel=fsdp: fsdp.PeakMemory, from before the model existed
{% endif %}


@dataclass
class Run(Problem):
    """The problem (`Problem`, built before the checks' dry step) and everything the run builds around it."""

    cfg: object
    run_dir: Path
    world: distributed.World
    device: torch.device
    stop: StopRequest
    # the loaders (`loaders`)
    train_loader: TrainLoader{% if cookiecutter.with_streams == "yes" %} | StreamLoader{% endif +%}
    val_loader: object
    # what trains the model (`training`)
    net: torch.nn.Module  # what the step calls: the model under DDP and torch.compile when on
    scheduler: object  # conf/schedule, stepped once per optimizer step
    scaler: torch.amp.GradScaler
    amp: torch.dtype | None  # autocast dtype, None = float32
    step: int  # optimizer steps done, over the whole run
    ema: EMA | None  # ema.decay: the averaged weights, what validation uses when on
    batch_transform: SeededBatchTransform | None  # data.batch_transform (MixUp, CutMix), training batches only
    ddp: torch.nn.parallel.DistributedDataParallel | None  # the DDP module under torch.compile's wrapper, when on
    # the records (`build`)
    runlog: RunLog
    monitor: Monitor
    checkpoints: checkpoint.CheckpointPolicy
    unexact: list  # ops run without a deterministic kernel (deterministic=warn): the run is bit-exact when empty
    own_draws: list  # the training data's generator of its own (data_check.own_draws): bit-exact when empty too
    carried: dict | None = None  # a mid-epoch checkpoint's running sums (EpochMeter.state), for the first epoch
    meter: EpochMeter | None = None  # the epoch's running figures, which a mid-epoch checkpoint keeps

    @property
    def evaluated(self) -> torch.nn.Module:
        """The weights validation, best.pth and eval.py judge: the EMA's when it is on."""
        return self.ema.model if self.ema is not None else self.model

    def no_sync(self, skip: bool):
{% if cookiecutter.with_fsdp == "yes" %}
        """On all but a window's last micro-batch, DDP's no_sync (FSDP's the same): their gradients add up locally,
        unreduced."""
        if skip and self.ddp is not None:
            return self.ddp.no_sync()
        if skip and fsdp.is_sharded(self.model):
            return fsdp.no_gradient_sync(self.model)
        return contextlib.nullcontext()
{% else %}
        """On all but a window's last micro-batch, DDP's no_sync: their gradients add up locally, unreduced."""
        if skip and self.ddp is not None:
            return self.ddp.no_sync()
        return contextlib.nullcontext()
{% endif %}

    def window_ends(self) -> bool:
        """Whether the micro-batch just taken closes an accumulation window (`accumulate_steps`): its last one,
        or the epoch's last batch. Windows start at each epoch's first batch; stops and saves fall on their ends."""
        return self.train_loader.position % self.cfg.accumulate_steps == 0 or self.train_loader.at_epoch_end

    def finished(self) -> bool:
        """All epochs done, or `max_steps` reached."""
        return self.train_loader.epoch >= self.cfg.epochs or self.at_max_steps()

    def at_max_steps(self) -> bool:
        return self.cfg.max_steps is not None and self.step >= self.cfg.max_steps

    def validation_due(self) -> bool:
        """A mid-epoch validation (`val_every_steps`); the epoch's end has its own."""
        every = self.cfg.val_every_steps
        return bool(every) and self.step % every == 0 and not self.train_loader.at_epoch_end

    def log_line_due(self) -> bool:
        """A steps.jsonl line: every `log_every_steps`, at saves, validations and epoch ends; the same steps in a run
        that stopped and was resumed as in one that never stopped."""
        every = self.step % self.cfg.log_every_steps == 0 or self.checkpoints.due(self.step) or self.validation_due()
        return every or self.train_loader.at_epoch_end

    def epoch_meter(self) -> EpochMeter:
        """A new epoch's running figures (`meter`); the first after a mid-epoch resume from the checkpoint's sums."""
        # a stream that starts its epoch over carries none
        self.meter = EpochMeter(self.device, self.carried if self.train_loader.position else None)
        self.carried = None
        return self.meter

    def train_batches(self):
        """This epoch's batches on the device and through `data.normalize`; the first one sets the memory plan."""
        show_bar = self.cfg.progress and sys.stderr.isatty() and self.world.is_main
        batches = device_batches(self.train_loader, self.device, self.cfg.device_prefetch)  # CUDA: copies overlap
        with failures.save_on_failure(self):  # a stall, a bad sample, a full /dev/shm: saved at the last step
            for batch in tqdm(batches, desc=f"epoch {self.train_loader.epoch}", disable=not show_bar, leave=False):
                if self.monitor.plan is None:  # the bytes the loader holds in flight (shapes, dtypes), logged once
                    self.monitor.set_plan(memory.plan(batch, self.train_loader.settings))
                batch = self.prepare(batch)
                if self.batch_transform is not None:  # keyed on (epoch, batch number): the same for any worker count
                    batch = self.batch_transform(batch, self.train_loader.epoch, self.train_loader.position - 1)
                yield batch

    def closing_line(self) -> str | None:
        """Where the run is, and the checkpoint that continues it (rank 0, once a checkpoint is on disk)."""
        if self.checkpoints.last is None:
            return None
        notes = [f"stopped by callback {self.callbacks.stopped_by}"] if self.callbacks.stopped_by else []
        notes += [f"not bit-exact ({', '.join(self.unexact)}: no deterministic kernel)"] if self.unexact else []
        notes += ["not bit-exact (data.train draws from a generator of its own)"] if self.own_draws else []
        all_epochs = self.train_loader.epoch >= self.cfg.epochs  # finished(), but not at max_steps
        return resume.where(
            self.run_dir, self.checkpoints.last, self.step, all_epochs, notes, self.at_max_steps(){% if cookiecutter.with_streams == "yes" %},
            not all_epochs and not self.train_loader.resumes_mid_epoch{% endif %},
        )  # fmt: skip


def build_problem(cfg, device: torch.device, resuming: bool) -> Problem:
    """Seed, then build the model (its init_from weights in, unless `resuming`), optimizer, task, callbacks, data
    sets and their collate and preparation, cheapest first: a refusal comes before the data is read."""
{% if cookiecutter.with_fsdp == "yes" %}
    sharded = cfg.parallel.strategy == "fsdp"  # the model's parameters split over the ranks (engine/fsdp.py)
    world = distributed.join(device, sharded)  # FSDP shards over a group, even of one; torchrun's ranks joined already
    peak = fsdp.PeakMemory(world) if sharded else None
{% endif %}
    rng.seed_everything(cfg.seed)
{% if cookiecutter.with_fsdp == "yes" %}
    if sharded:  # never whole on any rank (engine/fsdp.py); before the optimizer, which must hold the slices
        amp = amp_dtype(cfg.amp, device)
        model = fsdp.build(lambda: parts.model(cfg.model), cfg.parallel, amp, device, cfg.seed, cfg.channels_last)
    else:
        model = parts.model(cfg.model, device, cfg.channels_last)
{% else %}
    model = parts.model(cfg.model, device, cfg.channels_last)
{% endif %}
    if cfg.init_from and not resuming:  # weights only; a resume brings its own weights and says so
        parts.init_weights(model, cfg.init_from, cfg.init_strict)
    optimizer = parts.optimizer(cfg.optim, model)  # biases and norm weights without weight decay unless asked
    # the task and callbacks before restore: a resume's draws from the RNG are the same
    task = parts.build(cfg.task, "task")
    callbacks = Callbacks(cfg.get("callbacks"))
    train_set, val_set = parts.data_set(cfg.data, "train"), parts.data_set(cfg.data, "val")
    classes = {"train": getattr(train_set, "classes", None), "val": getattr(val_set, "classes", None)}
    check_classes(classes, cfg.data.get("num_classes"))
    collate = parts.collate(cfg.data, train_set)
    prepare = parts.prepare(cfg.data, device, cfg.channels_last)  # uint8 images -> normalized floats, on the device
    return Problem(model, optimizer, task, callbacks, train_set, val_set, collate, prepare{% if cookiecutter.with_fsdp == "yes" %}, peak{% endif %})


def build(cfg, run_dir: Path, stop: StopRequest, cleanup: contextlib.ExitStack, checked) -> Run:
    """Join the ranks, then build the loaders, what trains the model and the records around the problem the checks
    built, a resume's checkpoint loaded into them. `cleanup` closes what this opens, however the run ends. `checked`
    (preflight.check_run's): the ops the dry step found without a deterministic kernel (deterministic=warn), named here
    once, the checkpoint a resume continues, and the problem."""
    unexact, resumed, problem, own_draws = checked
    found, ckpt = resumed or (None, None)  # refused before the run when it changes the run (preflight)
    device = pick_device(cfg.device)
{% if cookiecutter.with_fsdp == "yes" %}
    sharded = cfg.parallel.strategy == "fsdp"  # the model's parameters split over the ranks (engine/fsdp.py)
    world = distributed.join(device, sharded, stop=stop)  # one process per rank under torchrun
{% else %}
    world = distributed.join(device, stop=stop)  # one process per rank under torchrun
{% endif %}
    cleanup.callback(distributed.leave, world)
    if not world.is_main:
        logging.getLogger().setLevel(logging.WARNING)  # rank 0 reports progress; the others speak only of problems
    if unexact and world.is_main:
        log.warning(
            "deterministic=warn: %s ran without a deterministic kernel: this run is not bit-exact, and neither is a "
            "resume of it", ", ".join(unexact),
        )  # fmt: skip
    if own_draws and world.is_main:
        log.warning(own_draws)
    if cfg.init_from and ckpt:
        log.info("init_from=%s is not used: resuming, the checkpoint holds the weights", cfg.init_from)
    train_loader, val_loader = loaders(cfg, problem, world, device, run_dir, ckpt)
    trained = training(cfg, problem, world, device, train_loader{% if cookiecutter.with_fsdp == "yes" %}, sharded{% endif %})
    # the records: the checkpoint policy, the run's logs (steps.jsonl, metrics.jsonl, TensorBoard{% if cookiecutter.with_tracking == "yes" %}, MLflow, W&B{% endif %})
    # and the worker health monitor; a resume's logs go on from the step after its checkpoint's
    saved_step = ckpt["step"] if ckpt else None
    policy = checkpoint.CheckpointPolicy(
        run_dir / "checkpoints", cfg.checkpoint, world, run_state.snapshot, saved_step{% if cookiecutter.with_fsdp == "yes" %}, sharded{% endif +%}
    )  # fmt: skip
{% if cookiecutter.with_tracking == "yes" %}
    trackers = tracking.start(cfg, run_dir, ckpt) if world.is_main else None  # MLflow, W&B
    runlog = RunLog(run_dir, saved_step + 1 if ckpt else None, world.is_main, trackers, cfg.logger.use)
{% else %}
    runlog = RunLog(run_dir, saved_step + 1 if ckpt else None, world.is_main)
{% endif %}
    cleanup.callback(runlog.close)
    monitor = Monitor(train_loader, runlog, cfg.monitor.every_steps)  # workers, memory, fds
    if train_loader.pick:  # loader=auto: its RAM budget held against the readings while training too
        monitor.budget_mib = train_loader.pick["budget"]["ram_mib"]
    run = Run(
        **vars(problem), cfg=cfg, run_dir=run_dir, world=world, device=device, stop=stop,
        train_loader=train_loader, val_loader=val_loader, **trained, step=0, runlog=runlog, monitor=monitor,
        checkpoints=policy, unexact=unexact, own_draws=[own_draws] if own_draws else [],
    )  # fmt: skip
    if ckpt:  # every part of the run back as it was saved, the main RNG last (engine/run_state.py)
        run_state.load(run, ckpt{% if cookiecutter.with_fsdp == "yes" %}, found{% endif %})
        if world.is_main:  # every refusal is behind: what changed, and where the run goes on
            resume.report(ckpt, cfg, found, train_loader)
{% if cookiecutter.with_tracking == "yes" %}
    cleanup.push(lambda *exc: end_tracking(run))  # closes RunLog first; returns None: an exception goes on
{% endif %}
    return run


def loaders(cfg, problem: Problem, world, device: torch.device, run_dir: Path, ckpt: dict | None) -> tuple:
    """The train loader, built once for the run, and the validation loader: the run's global batch over this run's
    processes, the batches in flight fitted to the memory there is, each rank its part of the data."""
    settings = resolve_settings(cfg.loader, device.type)
    if ckpt:  # the run's global batch, over this run's processes: the same steps whatever their number
        settings = replace(settings, batch_size=resume.per_rank_batch(ckpt, cfg, world.world_size))
    pick = None
    if loader_tuning.tuned_keys(cfg.loader):  # loader=auto: trials on this data and model pick them
        pick = loader_tuning.choose(cfg, problem, device, settings, ckpt, world)
        (run_dir / loader_tuning.pick_file(world.rank)).write_text(json.dumps(pick.saved(), indent=2))
        settings = pick.settings
    # before any worker starts: fit the batches in flight to loader.max_prefetch_mib and to the free /dev/shm
    settings, changes = memory.fit_loader(problem.train_set, settings, cfg.loader, problem.collate)
    for change in changes:
        log.warning("loader: %s", change)
    # what both loaders share: this rank's part, workers kept from stop signals until shielded, the collate
    shared = dict(rank=world.rank, world_size=world.world_size, worker_init=StopRequest.shield_worker,
                  collate_fn=problem.collate, start_guard=StopRequest.starting_workers)  # fmt: skip
{% if cookiecutter.with_streams == "yes" %}
    streamed = {"stream_resume": cfg.data.get("stream_resume", "exact")} if is_stream(problem.train_set) else {}
    train_loader = (StreamLoader if streamed else TrainLoader)(
{% else %}
    train_loader = TrainLoader(
{% endif %}
        problem.train_set,
        settings,
        seed=cfg.seed,
        rng_mode=cfg.rng_mode.value,
        on_bad_sample=cfg.data.get("on_bad_sample", "error"),
        bad_samples=failures.BadSampleLog(run_dir / failures.BAD_SAMPLES, world.rank),
        **shared,
{% if cookiecutter.with_streams == "yes" %}
        **streamed,
    )  # a stream's (engine/stream_loader.py) or an indexed data set's
{% else %}
    )
{% endif %}
    train_loader.pick = pick and pick.saved()  # the checkpoint carries it: a resume reuses it
    seed = cfg.seed if cfg.rng_mode.value == "per_sample" else None  # each validation sample seeded, as in training
    return train_loader, eval_loader(problem.val_set, settings, **shared, seed=seed)  # as eval.py's


def training(cfg, problem: Problem, world, device: torch.device, train_loader{% if cookiecutter.with_fsdp == "yes" %}, sharded: bool{% endif %}) -> dict:
    """The LR schedule, the loss scaler, the EMA, the batch transform and the net the step calls (DDP, torch.compile)
    around the problem's model and optimizer, as a fresh run starts them (a resume loads its checkpoint after)."""
    model, optimizer = problem.model, problem.optimizer
    amp = amp_dtype(cfg.amp, device)  # None: float32
    if amp is None and cfg.amp == "fp16":
        log.warning("amp=fp16 needs CUDA: training in float32 (amp=bf16 works on the CPU)")
{% if cookiecutter.with_streams == "yes" %}
    per_epoch = train_loader.batches_per_epoch  # None: a stream without sizes, whose length shows as it ends
    total_steps = None if per_epoch is None else cfg.epochs * -(-per_epoch // cfg.accumulate_steps)
{% else %}
    total_steps = cfg.epochs * -(-train_loader.batches_per_epoch // cfg.accumulate_steps)
{% endif %}
    scheduler = parts.schedule(cfg.schedule, optimizer, total_steps)
    scaler = torch.amp.GradScaler(device.type, enabled=amp == torch.float16)  # fp16 only: bf16 needs no scaling
{% if cookiecutter.with_fsdp == "yes" %}
    ema = None
    if sharded:  # the EMA sharded like the model
        if cfg.ema.decay is not None:  # the average kept in a second model sharded like the first
            twin = fsdp.build(
                lambda: parts.model(cfg.model), cfg.parallel, amp, device, cfg.seed, cfg.channels_last, model
            )
            ema = EMA(model, cfg.ema.decay, twin)
        plan = problem.peak.plan(model, optimizer, ema is not None)  # the plan, then the peaks, as a callback
        problem.callbacks.named.setdefault("fsdp_peak_memory", plan)
    net = model if sharded else distributed.wrap(model, device, world)  # DDP under torchrun: gradients averaged
{% else %}
    ema = None
    net = distributed.wrap(model, device, world)  # DDP under torchrun: gradients averaged
{% endif %}

    def throwaway() -> torch.Tensor:  # the task's loss on two training samples, without its parts
        batch = two_prepared(cfg.data, problem, device, "training")  # from a shallow copy of the training set
        return split_loss(problem.task.loss(net, batch))[0]

    distributed.settle_buckets(net, throwaway, undone(model, optimizer))
    if {% if cookiecutter.with_fsdp == "yes" %}not sharded and {% endif %}cfg.ema.decay is not None:  # after DDP's broadcast of rank 0's weights
        ema = EMA(model, cfg.ema.decay)
    batch_transform = parts.batch_transform(cfg.data)
    if batch_transform is not None:  # keyed on (epoch, batch number): the same draws for any worker count
        batch_transform = SeededBatchTransform(batch_transform, cfg.seed, world.rank)
    ddp = net if isinstance(net, torch.nn.parallel.DistributedDataParallel) else None
    if cfg.compile:
        net = torch.compile(net)  # compiles on the first steps; checkpoints keep the plain model's names
{% if cookiecutter.with_fsdp == "yes" %}
    amp = None if sharded else amp  # FSDP: its mixed-precision policy, not autocast
{% endif %}
    return dict(
        net=net,
        scheduler=scheduler,
        scaler=scaler,
        amp=amp,
        ema=ema,
        batch_transform=batch_transform,
        ddp=ddp,
    )
{% if cookiecutter.with_tracking == "yes" %}


def end_tracking(run: Run) -> None:
    """RunLog closed, its trackers given the paths of last.pth and best.pth to end their runs (finished, or stopped
    to resume)."""
    files = {"last": run.checkpoints.last, "best": run.checkpoints.folder / checkpoint.BEST}
    done = run.train_loader.epoch >= run.cfg.epochs
    run.runlog.close({kind: path for kind, path in files.items() if path is not None and path.is_file()}, done)
{% endif %}
