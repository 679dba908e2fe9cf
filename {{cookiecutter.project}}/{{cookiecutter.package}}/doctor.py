"""The loader doctor: measure every loader profile on your data without training, then recommend one.

    python -m {{ cookiecutter.package }}.doctor                          # the default data
    python -m {{ cookiecutter.package }}.doctor data=imagefolder data.root=/images data.num_classes=10
    python -m {{ cookiecutter.package }}.doctor loader.batch_size=128    # loader.* overrides apply to every profile

Each profile in conf/loader/ is built as train.py builds it and timed over two epochs of a part of the training set
(epoch 2 is where persistent workers pay off); the model's forward + backward is timed and its memory per rank added
up. docs/loader.md ("Loader doctor") explains the table's columns and the decision table the recommendation follows.
Last come the trials loader=auto would run, and its pick (engine/loader_tuning.py, the code train.py runs). The table,
the recommendation and the trials are printed, and everything goes to doctor.json in the run folder.
"""

import json
import logging
import os
import sys
import time
from pathlib import Path

import hydra
import psutil
import torch
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from torch.utils.data import default_collate

from .engine import distributed, failures, loader_tuning, memory, monitor, parts, rng, schema{% if cookiecutter.with_streams == "yes" %}, shard_plan{% endif +%}
from .engine.device import pick_device
from .engine.errors import CodeError, UserError, find_user_error, in_your_code
from .engine.loader import resolve_settings, usable_cpus
from .engine.optim import state_slots

log = logging.getLogger("doctor")

MiB = 2**20
MEMORY_SHARE = 0.5  # a profile whose peak passes this share of the available memory counts as memory-tight
START_SHARE = 0.05  # an epoch start costing more than this share of an epoch is worth persistent workers
SETTINGS = ("num_workers", "prefetch_factor", "persistent_workers", "pin_memory", "batch_size")  # into doctor.json


def wait_for_queue(expected_bytes: int) -> int:
    """Bytes of batches in shared memory once they stop growing (or reach what is expected), waiting 5 s at most."""
    pids = [os.getpid()] + [c.pid for c in psutil.Process().children(recursive=True)]
    best, steady_since, deadline = 0, time.time(), time.time() + 5
    while time.time() < deadline:
        now = monitor.shared_batches(pids)
        if now > best:
            best, steady_since = now, time.time()
        if best >= expected_bytes or time.time() - steady_since > 0.5:
            break
        time.sleep(0.05)
    return best


def measure(name: str, loader_cfg, dataset, device: torch.device, seed: int, collate) -> dict:
    """One profile, fitted and built as train.py builds it, timed over two epochs of a part of the data: enough
    batches that the queue turns over several times, few enough to stay quick."""
    log.info("measuring loader=%s", name)
    settings = resolve_settings(loader_cfg, device.type)
    try:  # as train.py fits it: to loader.max_prefetch_mib, then to the free space of /dev/shm
        settings, changes = memory.fit_loader(dataset, settings, loader_cfg, collate)
    except UserError as e:  # on_budget=error and over budget: this profile would not start
        return {"profile": name, "refused": str(e)}
    batches = max(40, 3 * settings.num_workers * (settings.prefetch_factor or 0) + 8)  # the queue turns over, quickly
    loader = loader_tuning.probe_loader(dataset, settings, batches * settings.batch_size, collate, seed)
    result = {"profile": name, **{k: getattr(settings, k) for k in SETTINGS}}
    result.update(budget_change="; ".join(changes) or None, batches_per_epoch=loader.batches_per_epoch)
    peak = loader_tuning.PeakPss()
    for epoch in (1, 2):
        asked, arrivals, workers = time.time(), [], {}
        for batch, report in loader:
            arrivals.append(time.time())
            if report is not None:  # a worker's first batch carries its first item's figures
                workers.setdefault(report[0], report)
            if epoch == 1 and len(arrivals) == 1:
                plan = memory.plan(batch, settings)
                result["plan"], result["plan_mib"] = plan.line(), plan.mib
                del batch  # the loader's generator still holds it: the one batch in hand, taken off below
                held = wait_for_queue(plan.bytes + plan.batch_bytes)
                result["in_flight_mib"] = max(held - plan.batch_bytes, 0) / MiB
        result[f"first_batch_e{epoch}_s"] = arrivals[0] - asked
        if epoch == 1:  # fresh workers: when the slowest began its first item, and how much longer that item took
            result["worker_start_s"] = max((began - asked for _, began, _ in workers.values()), default=None)
            result["dataset_init_s"] = max((slower for *_, slower in workers.values()), default=None)
    span = arrivals[-1] - arrivals[0]  # epoch 2 after its first batch
    result["batches_per_s"] = (len(arrivals) - 1) / span if span > 0 else None  # None: one batch, or no time
    result["peak_pss_mib"] = peak.result()
    del loader
    loader_tuning.workers_gone()
    return result


def model_memory(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
{% if cookiecutter.with_fsdp == "yes" %}
    """MiB of the model's parameters, gradients and optimizer state on each rank: whole under DDP, about 1/W of them
    under parallel=fsdp on W ranks (the loader's batches in flight come on top)."""
{% else %}
    """MiB of the model's parameters, gradients and optimizer state on each rank: whole under DDP (the loader's
    batches in flight come on top)."""
{% endif %}
    params = sum(p.numel() * p.element_size() for p in model.parameters()) / MiB
    slots = state_slots(optimizer)
    whole = params * (2 + slots)
{% if cookiecutter.with_fsdp == "yes" %}
    return {"parameters": params, "gradients": params, "optimizer_state": params * slots, "ddp_per_rank": whole,
            "fsdp_per_rank": {str(w): whole / w for w in (2, 4, 8)}}  # fmt: skip
{% else %}
    return {"parameters": params, "gradients": params, "optimizer_state": params * slots, "ddp_per_rank": whole}
{% endif %}


def recommend(
    results: list[dict], current: str, model_bps: float, available_mib: float, cores: int, full_batches: int
) -> dict:
    """The decision table of docs/loader.md, in its order: memory first, then a waiting model, then epoch starts."""
    ran = [r for r in results if r.get("batches_per_s")]
    if not ran:
        reasons = ["no profile produced two batches in epoch 2: nothing to compare"]
        return {"profile": current, "overrides": [], "reasons": reasons}
    now = next((r for r in ran if r["profile"] == current), ran[0])

    def mib(r: dict) -> float:  # the batches in flight are in no process's PSS
        return r["peak_pss_mib"] + r.get("in_flight_mib", 0.0)

    limit, rate, overrides = MEMORY_SHARE * available_mib, now["batches_per_s"], []
    fits = [r for r in ran if mib(r) <= limit]
    if mib(now) > limit:
        pick = min(ran, key=mib)
        reasons = [
            f"memory is tight: {current} peaks at {mib(now):.0f} MiB, over {MEMORY_SHARE:.0%} of the "
            f"{available_mib:.0f} MiB available; fewer workers and prefetch_factor 1 ({pick['profile']}) "
            f"peak at {mib(pick):.0f} MiB"
        ]
        if pick["num_workers"] > 1 or (pick["prefetch_factor"] or 0) > 1:  # the leanest profile, leaner still
            overrides += ["loader.num_workers=1", "loader.prefetch_factor=1"]
    elif rate < 1.1 * model_bps and fits:
        fastest = max(fits, key=lambda r: r["batches_per_s"])
        pick = fastest if fastest["batches_per_s"] > 1.1 * rate else now
        reasons = [
            f"the model waits on data: it takes {model_bps:.1f} batches/s, {current} delivers {rate:.1f}, and "
            "memory is free"
        ]
        if pick is not now:
            reasons.append(f"more workers: {pick['profile']} delivers {pick['batches_per_s']:.1f} batches/s")
        elif now["num_workers"] < cores:
            overrides.append(f"loader.num_workers={min(cores, 2 * max(now['num_workers'], 1))}")
            reasons.append(f"more workers: {cores} CPUs are usable, {current} uses {now['num_workers']}")
        else:
            reasons.append(
                f"the workers already use all {cores} CPUs: cheaper transforms, smaller images or more CPUs are "
                "what is left"
            )
    else:
        pick = now
        reasons = [
            f"{current} keeps up: {rate:.1f} batches/s from the loader, {model_bps:.1f} batches/s taken by the model"
        ]
    epoch_s, restart = full_batches / pick["batches_per_s"], pick["first_batch_e2_s"]
    if not pick["persistent_workers"] and pick["num_workers"] and restart > START_SHARE * epoch_s:
        overrides.append("loader.persistent_workers=true")
        reasons.append(
            f"slow epoch start: {restart:.2f} s each epoch to restart workers ({restart / epoch_s:.0%} of an "
            "epoch); persistent workers skip it, at the price of keeping their memory"
        )
    return {"profile": pick["profile"], "overrides": overrides, "reasons": reasons}


COLUMNS = [  # (key in doctor.json, header, format)
    ("profile", "profile", "{}"), ("num_workers", "workers", "{}"), ("prefetch_factor", "prefetch", "{}"),
    ("persistent_workers", "persistent", "{}"), ("plan_mib", "plan MiB", "{:.1f}"),
    ("in_flight_mib", "in flight MiB", "{:.1f}"), ("worker_start_s", "worker start s", "{:.2f}"),
    ("dataset_init_s", "dataset init s", "{:.2f}"), ("first_batch_e1_s", "1st batch e1 s", "{:.2f}"),
    ("first_batch_e2_s", "1st batch e2 s", "{:.2f}"), ("batches_per_s", "batches/s", "{:.1f}"),
    ("peak_pss_mib", "peak PSS MiB", "{:.0f}"),
]  # fmt: skip


def table(results: list[dict]) -> str:
    """One row a profile, the columns of COLUMNS aligned; a refused profile's row says why instead."""
    rows = [([h for _, h, _ in COLUMNS], None)]  # (cells, why the profile was refused)
    rows += [(["-" if r.get(k) is None else f.format(r[k]) for k, _, f in COLUMNS], r.get("refused")) for r in results]
    widths = [max(len(row[i]) for row, no in rows if no is None) for i in range(len(COLUMNS))]
    cells = ("  ".join(map(str.rjust, row[1:], widths[1:])) if no is None else f"refused: {no}" for row, no in rows)
    return "\n".join(row[0].ljust(widths[0]) + "  " + line for (row, _), line in zip(rows, cells))


def diagnose(cfg) -> None:
    """Every profile of conf/loader/ measured, the model timed and sized, doctor.json written, the table printed."""
    hydra_cfg, device = HydraConfig.get(), pick_device(cfg.device)
    rng.seed_everything(cfg.seed)
    run_dir, current = Path(hydra_cfg.runtime.output_dir), hydra_cfg.runtime.choices.get("loader", "balanced")
    overrides = [o for o in hydra_cfg.overrides.task if not o.startswith("loader=")]
    available_mib, cores = psutil.virtual_memory().available / MiB, usable_cpus()
    space = failures.shm_space()  # (free, size) of where the batches in flight live, or None
    shm_free, shm_size = (None, None) if space is None else (n / MiB for n in space)
    began = time.perf_counter()
    train_set = parts.data_set(cfg.data, "train")
    build_s = time.perf_counter() - began
    collate = parts.collate(cfg.data, train_set) or default_collate  # as train.py collates the batches
    profiles = {name: hydra.compose(config_name="config", overrides=[*overrides, f"loader={name}"]).loader
                for name in GlobalHydra.instance().config_loader().get_group_options("loader")}  # fmt: skip
    fixed = {name: loader for name, loader in profiles.items() if not loader_tuning.tuned_keys(loader)}
    results = [measure(name, loader, train_set, device, cfg.seed, collate) for name, loader in fixed.items()]
    step = loader_tuning.ModelStep(cfg, device)  # the model timed as loader=auto's trials time it
    model_bps = step.batches_per_s(train_set, collate, cfg.loader.batch_size)
    weights = model_memory(step.model, parts.optimizer(cfg.optim, step.model))
    auto = profiles.get("auto")  # the trials loader=auto would run here, and its pick: the same code as train.py's
    if auto is not None:
        print("loader=auto's trials:", flush=True)
        base = resolve_settings(auto, device.type)
        length = loader_tuning.batches_of_run(cfg, train_set, base.batch_size)
        pick = loader_tuning.tune(train_set, collate, step, base, loader_tuning.tuned_keys(auto),
                                  loader_tuning.Budget.of(auto), cfg.seed, cfg.rng_mode.value, length,
                                  say=lambda line, *a: print("  " + line % a, flush=True),
                                  skip=cfg.data.get("on_bad_sample", "error") == "skip")  # fmt: skip
{% if cookiecutter.with_streams == "yes" %}
    sizes = shard_plan.shard_sizes(train_set) if shard_plan.is_shard_stream(train_set) else None  # None: not known
    samples = sum(sizes) if sizes is not None else None if shard_plan.is_stream(train_set) else len(train_set)
{% else %}
    samples = len(train_set)
{% endif %}
    full_batches = max((samples or 0) // cfg.loader.batch_size, 1)
    advice = recommend(results, current, model_bps, available_mib, cores, full_batches)
    report = {
        "machine": {"cpus": cores, "available_mib": available_mib, "shm_free_mib": shm_free, "shm_size_mib": shm_size,
                    "device": str(device), "torch": torch.__version__, "python": sys.version.split()[0]},
        "data": {"train_samples": samples, "build_s": build_s, "full_epoch_batches": full_batches},
        "model_batches_per_s": model_bps, "model_memory_mib": weights, "current": current, "profiles": results,
        "recommendation": advice, "auto": pick.saved() if auto is not None else None,
    }  # fmt: skip
    (run_dir / "doctor.json").write_text(json.dumps(report, indent=2))
    lines = [
        table(results),
        f"\nmodel ({cfg.model._target_.rsplit('.', 1)[-1]} on {device}): {model_bps:.1f} batches/s; "
        f"{available_mib:.0f} MiB available, {cores} CPUs; dataset built in {build_s:.2f} s",
        f"model memory per rank: parameters {weights['parameters']:.1f} MiB + gradients {weights['gradients']:.1f} + "
        f"optimizer state {weights['optimizer_state']:.1f} = {weights['ddp_per_rank']:.1f} MiB under DDP",
    ]
{% if cookiecutter.with_fsdp == "yes" %}
    ranks = ", ".join(f"{mib:.1f} on {w}" for w, mib in weights["fsdp_per_rank"].items())
    lines[-1] += f"; parallel=fsdp: {ranks} ranks"
{% endif %}
    if shm_free is not None:
        lines.append(f"{failures.SHM_DIR}: {shm_free:.1f} MiB free of {shm_size:.1f} MiB (batches in flight)")
    lines += [f"{r['profile']}: {r['budget_change']}" for r in results if r.get("budget_change")]
    if auto is not None:
        lines.append(f"loader=auto would pick {pick.why} ({len(pick.trials)} trials, {pick.tuned_s:.1f} s)")
    line = " ".join([f"loader={advice['profile']}", *advice["overrides"]])
    lines += [f"recommendation: {line}\n  - " + "\n  - ".join(advice["reasons"]), f"written: {run_dir / 'doctor.json'}"]
    print("\n".join(lines))


def run(cfg) -> None:
    """diagnose(), a known failure (bad input, a dead worker) said in one `error:` line, exit 2; an exception in your
    code with its traceback first, exit 1."""
    try:
        diagnose(cfg)
    except Exception as e:
        error = find_user_error(e) or failures.worker_death(e) or in_your_code(e, "doctor")
        if error is None:
            raise
        distributed.refuse(str(error), trace=getattr(error, "trace", ""), code=1 if isinstance(error, CodeError) else 2)


def main() -> None:
    """The project's Hydra config: `./conf` (run from the project root, as train.py is), else the conf/ beside this
    package in a source checkout (an installed package holds no conf/ of its own)."""
    folders = (Path.cwd() / "conf", Path(__file__).resolve().parents[1] / "conf")
    folder = next((f for f in folders if (f / "config.yaml").is_file()), None)
    if folder is None:
        where = f"no conf/config.yaml in {str(Path.cwd())!r}"
        distributed.refuse(f"{where}: run the doctor from your project's root, the folder holding train.py and conf/")
    schema.register()  # the schema conf/config.yaml lists first
    hydra.main(config_path=str(folder), config_name="config", version_base="1.3")(run)()


if __name__ == "__main__":
    main()
