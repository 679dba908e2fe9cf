"""Train an image classifier: one DataLoader reused every epoch, and a resume that continues the same run.

    python train.py                          # defaults from conf/config.yaml
    python train.py loader=throughput optim=adamw epochs=20
    python train.py resume=latest            # continue the newest run, bit for bit

The machinery lives next to this file in {{ cookiecutter.package }}/: data, loader, device, evaluate, checkpoint,
resume, rng, runlog, monitor, schedule, model.
"""

import contextlib
import logging
import os
import sys
import time
from pathlib import Path

import hydra
import torch
import torch.nn.functional as F
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from tqdm import tqdm

from {{ cookiecutter.package }} import checkpoint, config, distributed, memory, resume, rng, submit
from {{ cookiecutter.package }}.device import amp_dtype, device_batches, input_transform, sum_and_read
from {{ cookiecutter.package }}.errors import UserError, find_user_error
from {{ cookiecutter.package }}.evaluate import evaluate
from {{ cookiecutter.package }}.loader import TrainLoader, eval_loader, resolve_settings
from {{ cookiecutter.package }}.monitor import Monitor, worker_death
from {{ cookiecutter.package }}.preempt import StopRequest
from {{ cookiecutter.package }}.runlog import RunLog
from {{ cookiecutter.package }}.schedule import warmup_cosine

log = logging.getLogger("train")
submit.picklable_modules()  # `-m hydra/launcher=slurm` pickles main() by value, torch.backends.cudnn too: see submit.py


def train(cfg) -> tuple[int, float]:
    hydra_cfg = HydraConfig.get()
    config.check(cfg, hydra_cfg.runtime.choices, list(hydra_cfg.overrides.task))  # every key, before any work
    run_dir = Path(hydra_cfg.runtime.output_dir)
    stop = StopRequest()  # before workers fork: they inherit a handler that only sets a flag
    device = pick_device(cfg.device, cfg.deterministic)
    stopping = False  # a signal asked to stop, and every rank agreed to stop at the same step
    with contextlib.ExitStack() as cleanup:  # however train() leaves, exceptions included, this closes what it opened
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
        best = checkpoint.Best(cfg.checkpoint.monitor, cfg.checkpoint.mode.value, ckpt)  # best epoch so far

        train_set, val_set = instantiate(cfg.data.train), instantiate(cfg.data.val)
        config.check_data(train_set, val_set, cfg.data.num_classes)
        settings = resolve_settings(cfg.loader, device.type)
        if cfg.loader.max_prefetch_mib is not None:  # before any worker starts: fit the batches in flight to the budget
            settings, change = memory.fit_budget(
                settings,
                memory.sample_batch_bytes(train_set, settings.batch_size),
                cfg.loader.max_prefetch_mib,
                cfg.loader.on_budget,
            )
            if change:
                log.warning("loader: %s", change)
        train_loader = TrainLoader(
            train_set,
            settings,
            seed=cfg.seed,
            rng_mode=cfg.rng_mode.value,
            rank=world.rank,
            world_size=world.world_size,
            worker_init=StopRequest.shield_worker,
        )  # built once
        prepare = input_transform(cfg.data, device, cfg.channels_last)  # uint8 batches -> normalized floats, on device
        model = instantiate(cfg.model, num_classes=cfg.data.num_classes).to(device)
        if cfg.channels_last:
            model = model.to(memory_format=torch.channels_last)
        optimizer = instantiate(cfg.optim)(model.parameters())
        scheduler = warmup_cosine(optimizer, cfg.epochs * train_loader.batches_per_epoch, **cfg.schedule)
        amp = amp_dtype(cfg.amp, device)  # None: float32
        if amp is None and str(cfg.amp).lower() in ("fp16", "true"):
            log.warning("amp=fp16 needs CUDA: training in float32 (amp=bf16 works on the CPU)")
        scaler = torch.amp.GradScaler(device.type, enabled=amp == torch.float16)  # fp16 only: bf16 needs no scaling
        step = resume.restore(ckpt, cfg, model, optimizer, scheduler, scaler, train_loader, world.rank) if ckpt else 0
        net = distributed.wrap(model, device, world)  # DDP under torchrun: gradients averaged across ranks
        if cfg.compile:
            net = torch.compile(net)  # compiles on the first steps; checkpoints keep the plain model's names
        if ckpt:
            log.info("resumed from step %d (epoch %d, batch %d)", step, train_loader.epoch, train_loader.position)
        val_loader = eval_loader(val_set, settings, world.rank, world.world_size, worker_init=StopRequest.shield_worker)
        checkpoints = checkpoint.Checkpointer(run_dir / "checkpoints", cfg.checkpoint.keep) if world.is_main else None
        runlog = cleanup.enter_context(RunLog(run_dir, purge_step=step + 1 if ckpt else None, enabled=world.is_main))
        monitor = Monitor(train_loader, runlog, cfg.monitor.every_steps)  # workers, memory, fds, data wait
        show_bar = cfg.progress and sys.stderr.isatty() and world.is_main
        log_every, save_every = cfg.log_every_steps, cfg.checkpoint.every_steps

        def save(record: dict | None = None) -> None:  # every rank hands its RNG and loader state to rank 0
            ranks = distributed.gather_to_main(resume.rank_state(train_loader), world)
            if world.is_main:
                state = checkpoint.snapshot(cfg, step, model, optimizer, scheduler, scaler, train_loader, ranks)
                state["best"] = best.state()
                if record is not None:  # an epoch end: best.pth too when this epoch is the best so far
                    best.update(record, state, checkpoints)
                checkpoints.save(state)
            distributed.barrier(world)

        while not stopping and train_loader.epoch < cfg.epochs and (cfg.max_steps is None or step < cfg.max_steps):
            epoch = train_loader.epoch
            model.train()
            # Sums stay on the device and are read at log points only: a read makes the host wait for the device.
            epoch_loss = torch.zeros((), dtype=torch.float64, device=device)  # sum of loss x batch size
            window_loss = torch.zeros((), dtype=torch.float64, device=device)  # sum of losses since the last log line
            window_steps = 0
            samples, data_wait, started = 0, 0.0, time.perf_counter()
            waiting_since = started
            batches = device_batches(train_loader, device, cfg.device_prefetch)  # CUDA: copies overlap compute
            for x, y in tqdm(batches, desc=f"epoch {epoch}", disable=not show_bar, leave=False):
                data_wait += time.perf_counter() - waiting_since  # time the loop stood still waiting on the loader
                if monitor.plan is None:  # the first batch: log the bytes the loader holds in flight (shapes, dtypes)
                    monitor.set_plan(memory.plan((x, y), train_loader.settings))
                with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
                    loss = F.cross_entropy(net(prepare(x)), y)
                optimizer.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                scheduler.step()
                step += 1
                loss = loss.detach().double()
                window_loss += loss
                epoch_loss += loss * len(y)
                window_steps, samples = window_steps + 1, samples + len(y)
                # One process acts on a signal at the next step (the flag is a Python bool, no device read);
                # ranks agree on it where they read the loss anyway, so all stop after the same step.
                stopping = stop.requested and not world.distributed
                epoch_end = train_loader.position == train_loader.batches_per_epoch
                if stopping or epoch_end or step % log_every == 0 or step == cfg.max_steps:
                    window_sum, signalled = sum_and_read([window_loss, stop.requested], device, world)
                    runlog.step(step, window_sum / world.world_size / window_steps, scheduler.get_last_lr()[0])
                    window_loss.zero_()
                    window_steps, stopping = 0, signalled > 0
                monitor.step(step, data_wait, started)  # health every monitor.every_steps and at the epoch's last batch
                if stopping or step == cfg.max_steps or (save_every and step % save_every == 0):
                    save()
                if stopping or step == cfg.max_steps:
                    break
                waiting_since = time.perf_counter()
            if stopping or step == cfg.max_steps:
                break  # mid-epoch: no validation; the checkpoint holds the position in the epoch
            train_time = time.perf_counter() - started
            if train_loader.epoch < cfg.epochs:  # persistent workers queue the next epoch's first batches meanwhile
                train_loader.start_next_epoch()
            val_loss, val_acc = evaluate(model, val_loader, device, world, prepare)
            loss_sum, samples, rate, signalled = sum_and_read(
                [epoch_loss, samples, samples / train_time, stop.requested], device, world
            )
            record = {
                "epoch": epoch,
                "step": step,
                "train_loss": loss_sum / max(samples, 1),
                "val_loss": val_loss,
                "val_acc": val_acc,
                "lr": scheduler.get_last_lr()[0],
                "samples_per_s": rate,
                "data_wait_s": data_wait,
                "epoch_time_s": train_time,
                "worker_pids": sorted(train_loader.worker_pids),
                **monitor.epoch(data_wait, train_time),  # worker_count, rss_mib, pss_mib, fds, data_wait_share
            }
            runlog.epoch(record)
            log.info(
                "epoch %d step %d train_loss %.4f val_loss %.4f val_acc %.4f %.0f samples/s data_wait %.2fs",
                epoch,
                step,
                record["train_loss"],
                val_loss,
                val_acc,
                rate,
                data_wait,
            )
            save(record)
            stopping = signalled > 0
        if world.is_main and checkpoints.last.is_file():  # where the run is, and the command that continues it
            log.info(
                resume.where(
                    run_dir,
                    checkpoints.last,
                    step,
                    train_loader.epoch >= cfg.epochs,
                    list(hydra_cfg.overrides.task),
                    world.world_size,
                )
            )
    best_value = best.value if best.value is not None else float("nan")
    if stopping:
        stop.hand_over()  # e.g. submitit requeues the SLURM job now that the checkpoint is on disk
        return stop.exit_code, best_value
    return 0, best_value


def pick_device(choice, deterministic: bool) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise UserError("device=cuda but no CUDA device is visible: use device=cpu or device=auto")
    device = torch.device("cuda" if choice != "cpu" and torch.cuda.is_available() else "cpu")
    if deterministic:  # the same inputs give the same bits: what makes an exact resume checkable
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
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
        sys.exit(2)
    if code:
        sys.exit(code)
    return best


if __name__ == "__main__":
    config.register()  # the schema Hydra checks conf/config.yaml against
    config.check_command_line(sys.argv[1:], Path(__file__).parent / "conf")  # a typo: one line, not Hydra's report
    main()
