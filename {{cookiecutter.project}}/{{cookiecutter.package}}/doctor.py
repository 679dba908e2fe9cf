"""The loader doctor: measure every loader profile on your data without training, then recommend one.

    python -m {{ cookiecutter.package }}.doctor                          # the default data
    python -m {{ cookiecutter.package }}.doctor data=imagefolder data.root=/images data.num_classes=10
    python -m {{ cookiecutter.package }}.doctor loader.batch_size=128    # loader.* overrides apply to every profile

Run it from the project root, as train.py: it reads the Hydra config in `./conf` (or, from a source
checkout, the conf/ beside this package), so it works from an installed package too.

Each profile in conf/loader/ is built as train.py builds it (resolve_settings, the memory budget,
TrainLoader) and run for two epochs over an evenly spaced part of the training set
(`batches_per_epoch()` batches), because epoch 2 is where persistent workers pay off. Measured:

- worker start: from asking for the epoch's first batch until a worker begins its first item
  (process start and worker_init_fn); the slowest worker counts, since the epoch waits for it.
- dataset init in a worker: how much longer a worker's first item takes than its later ones
  (files opened lazily, caches, decoders warming up).
- first batch, epochs 1 and 2: how long the loop waits at each epoch start.
- steady batches/s: epoch 2 after its first batch.
- peak PSS: main process + workers, polled every 0.2 s or more (at most a tenth of a core).
- the prefetch plan, and what was measured in shared memory once the queue had filled.
- model batches/s: forward + backward of the configured model on one batch, on the run's device;
  the rate the loader has to keep up with.
{% if cookiecutter.with_fsdp == "yes" %}
- model memory per rank: its parameters, gradients and optimizer state, whole under DDP and about 1/W of them
  under parallel=fsdp on W ranks.
{% else %}
- model memory per rank: its parameters, gradients and optimizer state, whole on every rank under DDP.
{% endif %}

The recommendation follows the decision table in docs/loader.md ("Loader doctor"): memory tight -> fewer
workers and prefetch_factor 1; model waiting on data and memory free -> more workers; costly epoch
starts -> persistent workers. A table is printed and everything goes to doctor.json in the run folder.
"""

from __future__ import annotations

import gc
{% if cookiecutter.with_streams == "yes" %}
import itertools
{% endif %}
import json
import logging
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import hydra
import numpy as np
import psutil
import torch
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
{% if cookiecutter.with_streams == "yes" %}
from torch.utils.data import Dataset, IterableDataset, Subset, default_collate, get_worker_info

from .engine import {% if cookiecutter.with_fsdp == "yes" %}fsdp, {% endif %}memory, monitor, parts, rng, schema, shard_plan
from .engine.device import to_device
from .engine.errors import UserError, find_user_error
from .engine.loader import TrainLoader, resolve_settings, usable_cpus
from .engine.shard_plan import is_stream
from .engine.stream_loader import StreamLoader
{% else %}
from torch.utils.data import Dataset, Subset, default_collate, get_worker_info

from .engine import {% if cookiecutter.with_fsdp == "yes" %}fsdp, {% endif %}memory, monitor, parts, rng, schema
from .engine.device import to_device
from .engine.errors import UserError, find_user_error
from .engine.loader import TrainLoader, resolve_settings, usable_cpus
{% endif %}
from .engine.task_results import split_loss

log = logging.getLogger("doctor")

MiB = 2**20
MEMORY_SHARE = 0.5  # a profile whose peak passes this share of the available memory counts as memory-tight
START_SHARE = 0.05  # an epoch start costing more than this share of an epoch is worth persistent workers


def batches_per_epoch(settings) -> int:
    """Enough batches that the queue turns over several times, few enough to stay quick."""
    return max(40, 3 * settings.num_workers * (settings.prefetch_factor or 0) + 8)


class ItemTimes:
    """How long items take in the process that makes them: its first item, and the ones after."""

    def __init__(self):
        self.first: tuple[float, float] | None = None  # (wall-clock start, seconds) of this process's first item
        self.later: list[float] = []

    def note(self, began: float) -> None:
        """An item that began at `began` (time.time(): wall clock, comparable between processes) is made."""
        took = time.time() - began
        if self.first is None:
            self.first = (began, took)
        else:
            self.later = self.later[-200:] + [took]


class Probe(ItemTimes, Dataset):
    """Times each item of an indexed data set."""

    def __init__(self, dataset):
        super().__init__()
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        began = time.time()
        item = self.dataset[index]
        self.note(began)
        return item
{% if cookiecutter.with_streams == "yes" %}


class StreamProbe(ItemTimes, IterableDataset):
    """Probe's twin for a stream: each reader's records timed as they are read, `count` of them in all. A shard
    stream's shards are split over the workers; any other stream splits itself."""

    def __init__(self, dataset, count: int):
        super().__init__()
        self.dataset, self.count = dataset, count

    def __iter__(self):
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        if shard_plan.is_shard_stream(self.dataset):
            shards = list(self.dataset.shards)[worker::workers]
            records = (record for shard in shards for record in self.dataset.read(shard))
        else:
            records = iter(self.dataset)
        records = itertools.islice(records, max(self.count // workers, 1))
        while True:
            began = time.time()
            item = next(records, None)
            if item is None:
                return
            self.note(began)
            yield item
{% endif %}


class ProbeCollate:
    """The run's collate (default_collate, data.collate{% if cookiecutter.with_photos == "yes" %}, data.decode=gpu's{% endif %}: parts.collate), plus the worker's
    first-item figures riding along with the batch."""

    def __init__(self, probe: Probe, collate=None):
        self.probe = probe  # the same object as the worker's dataset copy: fork and pickling both keep the identity
        self.collate = collate or default_collate

    def __call__(self, samples):
        info = get_worker_info()
        first = self.probe.first or (time.time(), 0.0)
        steady = statistics.median(self.probe.later) if self.probe.later else 0.0
        return self.collate(samples), {
            "pid": os.getpid(),
            "worker": info is not None,
            "began": first[0],
            "first_s": first[1],
            "steady_s": steady,
        }


class PeakPss:
    """Polls monitor.pss_mib() in a thread until stopped; keeps the highest reading.

    A reading costs ~10 ms of kernel time per process (smaps_rollup walks the page tables), so the
    poll waits at least ten times what the last reading took: at most a tenth of a core."""

    def __init__(self, every_s: float = 0.2):
        self.every_s, self.peak, self._stop = every_s, 0.0, threading.Event()
        self._wait = every_s
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, monitor.pss_mib())

    def _run(self) -> None:
        while not self._stop.wait(self._wait):
            began = time.perf_counter()
            self.peak = max(self.peak, monitor.pss_mib())
            self._wait = max(self.every_s, 10 * (time.perf_counter() - began))


def wait_for_queue(expected_bytes: int, timeout_s: float = 5.0) -> int:
    """Bytes of batches in shared memory once they stop growing (or reach what is expected)."""
    pids = [os.getpid()] + [c.pid for c in psutil.Process().children(recursive=True)]
    best, steady_since, deadline = 0, time.time(), time.time() + timeout_s
    while time.time() < deadline:
        now = monitor.shared_batches(pids)
        if now > best:
            best, steady_since = now, time.time()
        if best >= expected_bytes or time.time() - steady_since > 0.5:
            break
        time.sleep(0.05)
    return best


def wait_for_workers_to_exit(timeout_s: float = 10.0) -> None:
    gc.collect()  # the DataLoader iterator shuts its workers down when collected
    deadline = time.time() + timeout_s
    while psutil.Process().children() and time.time() < deadline:
        time.sleep(0.05)


def measure(name: str, loader_cfg, dataset, device: torch.device, seed: int, collate=None) -> dict:
    settings = resolve_settings(loader_cfg, device.type)
    try:  # as train.py fits it: to loader.max_prefetch_mib, then to the free space of /dev/shm
        settings, changes = memory.fit_loader(dataset, settings, loader_cfg, collate)
        change = "; ".join(changes) or None
    except UserError as e:  # on_budget=error and over budget: this profile would not start
        return {"profile": name, "refused": str(e)}
{% if cookiecutter.with_streams == "yes" %}
    if is_stream(dataset):  # the stream's first records, read as train.py reads them (StreamLoader)
        probe = StreamProbe(dataset, batches_per_epoch(settings) * settings.batch_size)
        loader = StreamLoader(probe, settings, seed=seed, collate_fn=ProbeCollate(probe, collate))
    else:
        count = min(len(dataset), batches_per_epoch(settings) * settings.batch_size)
        part = Subset(dataset, np.linspace(0, len(dataset) - 1, count).round().astype(np.int64).tolist())
        probe = Probe(part)
        loader = TrainLoader(probe, settings, seed=seed, collate_fn=ProbeCollate(probe, collate))
{% else %}
    count = min(len(dataset), batches_per_epoch(settings) * settings.batch_size)
    part = Subset(dataset, np.linspace(0, len(dataset) - 1, count).round().astype(np.int64).tolist())
    probe = Probe(part)
    loader = TrainLoader(probe, settings, seed=seed, collate_fn=ProbeCollate(probe, collate))
{% endif %}
    result = {
        "profile": name,
        "num_workers": settings.num_workers,
        "prefetch_factor": settings.prefetch_factor,
        "persistent_workers": settings.persistent_workers,
        "pin_memory": settings.pin_memory,
        "batch_size": settings.batch_size,
        "budget_change": change,
        "batches_per_epoch": loader.batches_per_epoch,
    }
    with PeakPss() as peak:
        for epoch in (1, 2):
            asked, arrivals, reports = time.time(), [], {}
            for batch, report in loader:
                arrivals.append(time.time())
                if report["worker"]:
                    reports.setdefault(report["pid"], report)  # a worker's first batch carries its first item
                if epoch == 1 and len(arrivals) == 1:
                    plan = memory.plan(batch, settings)
                    result["plan"], result["plan_mib"] = plan.line(), plan.mib
                    del batch  # the loader's generator still holds it: the one batch in hand, taken off below
                    held = wait_for_queue(plan.bytes + plan.batch_bytes)
                    result["in_flight_mib"] = max(held - plan.batch_bytes, 0) / MiB
            result[f"first_batch_e{epoch}_s"] = arrivals[0] - asked
            if epoch == 1:  # fresh workers: when each began its first item, and how much longer that item took
                result["worker_start_s"] = max((r["began"] - asked for r in reports.values()), default=None)
                result["dataset_init_s"] = max(
                    (max(r["first_s"] - r["steady_s"], 0.0) for r in reports.values()), default=None
                )
            else:
                span = arrivals[-1] - arrivals[0]
                result["batches_per_s"] = (len(arrivals) - 1) / span if len(arrivals) > 1 and span > 0 else None
    result["peak_pss_mib"] = peak.peak
    del loader, probe
    wait_for_workers_to_exit()
    return result
{% if cookiecutter.with_streams == "yes" %}


def stream_records(dataset) -> int | None:
    """A stream's records per epoch: its shards' sizes added, or None where it does not say."""
    sizes = shard_plan.shard_sizes(dataset) if shard_plan.is_shard_stream(dataset) else None
    return None if sizes is None else sum(sizes)
{% endif %}


def model_rate(cfg, dataset, batch_size: int, device: torch.device, steps: int = 5) -> float:
    """Batches/s of forward + backward for the configured model on one batch: the pace the loader must keep."""
    saved = rng.capture()  # the model's initialisation draws from the main RNG; leave it as it was
    try:
        model = parts.model(cfg).to(device)
        task = parts.task(cfg)
        collate = parts.collate(cfg, dataset) or default_collate
{% if cookiecutter.with_streams == "yes" %}
        if is_stream(dataset):
            samples = shard_plan.first_records(dataset, batch_size)
            samples = [samples[i % len(samples)] for i in range(batch_size)]
        else:
            samples = [dataset[i % len(dataset)] for i in range(batch_size)]
{% else %}
        samples = [dataset[i % len(dataset)] for i in range(batch_size)]
{% endif %}
        batch = collate(samples)
    finally:
        rng.apply(saved)
    batch = parts.prepare(cfg, device, False)(to_device(batch, device))  # uint8 -> normalized floats, as train.py
    for i in range(steps + 2):  # two warm-up steps, then the timed ones
        if i == 2:
            if device.type == "cuda":
                torch.cuda.synchronize()
            began = time.perf_counter()
        model.zero_grad(set_to_none=True)
        split_loss(task.loss(model, batch))[0].backward()  # a bare loss or (loss, parts)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return steps / (time.perf_counter() - began)


{% if cookiecutter.with_fsdp == "yes" %}
def model_memory(cfg) -> dict:
    """MiB of the model's parameters, gradients and optimizer state on each rank: whole under DDP, about 1/W of
    them under parallel=fsdp on W ranks (the loader's batches in flight come on top)."""
    with torch.random.fork_rng(devices=[]):  # the model's initialisation draws: leave the RNG as it was
        model = parts.model(cfg)
    params = sum(p.numel() * p.element_size() for p in model.parameters()) / MiB
    slots = fsdp.state_slots(parts.optimizer(cfg, model))
    whole = params * (2 + slots)
    return {"parameters": params, "gradients": params, "optimizer_state": params * slots, "ddp_per_rank": whole,
            "fsdp_per_rank": {str(w): whole / w for w in (2, 4, 8)}}  # fmt: skip
{% else %}
def model_memory(cfg) -> dict:
    """MiB of the model's parameters, gradients and optimizer state on each rank, whole under DDP (the loader's
    batches in flight come on top)."""
    with torch.random.fork_rng(devices=[]):  # the model's initialisation draws: leave the RNG as it was
        model = parts.model(cfg)
    params = sum(p.numel() * p.element_size() for p in model.parameters()) / MiB
    slots = state_slots(parts.optimizer(cfg, model))
    whole = params * (2 + slots)
    return {"parameters": params, "gradients": params, "optimizer_state": params * slots, "ddp_per_rank": whole}


# Per-parameter state tensors the shipped optimizers keep, shaped like the parameter: Adam's two moments, SGD's
# momentum buffer when momentum is on.
def state_slots(optimizer: torch.optim.Optimizer) -> int:
    defaults = optimizer.defaults
    if "betas" in defaults:
        return 2
    return 1 if defaults.get("momentum") else 0
{% endif %}


def recommend(
    results: list[dict], current: str, model_bps: float, available_mib: float, cores: int, full_batches: int
) -> dict:
    """The decision table of docs/loader.md, in its order: memory first, then a waiting model, then epoch starts."""
    ran = [r for r in results if "refused" not in r and r.get("batches_per_s")]
    if not ran:
        why = "no profile produced two batches in epoch 2: nothing to compare"
        return {"profile": current, "overrides": [], "reasons": [why]}
    by_name = {r["profile"]: r for r in ran}
    now = by_name.get(current, ran[0])
    # batches in flight are in no process's PSS: add them
    footprint = {r["profile"]: r["peak_pss_mib"] + r.get("in_flight_mib", 0.0) for r in ran}
    fits = [r for r in ran if footprint[r["profile"]] <= MEMORY_SHARE * available_mib]
    reasons, overrides = [], []
    if footprint[now["profile"]] > MEMORY_SHARE * available_mib:
        leanest = min(ran, key=lambda r: footprint[r["profile"]])
        pick = leanest
        reasons.append(
            f"memory is tight: {current} peaks at {footprint[current]:.0f} MiB, over {MEMORY_SHARE:.0%} "
            "of the "
            f"{available_mib:.0f} MiB available; fewer workers and prefetch_factor 1 ({leanest['profile']}) "
            f"peak at {footprint[leanest['profile']]:.0f} MiB"
        )
        if leanest["num_workers"] > 1 or (leanest["prefetch_factor"] or 0) > 1:
            overrides += ["loader.num_workers=1", "loader.prefetch_factor=1"]
    elif now["batches_per_s"] < 1.1 * model_bps and fits:
        fastest = max(fits, key=lambda r: r["batches_per_s"])
        pick = fastest if fastest["batches_per_s"] > 1.1 * now["batches_per_s"] else now
        reasons.append(
            f"the model waits on data: it takes {model_bps:.1f} batches/s, {current} delivers "
            f"{now['batches_per_s']:.1f}, and memory is free"
        )
        if pick is not now:
            reasons.append(f"more workers: {pick['profile']} delivers {pick['batches_per_s']:.1f} batches/s")
        elif now["num_workers"] < cores:
            overrides.append(f"loader.num_workers={min(cores, 2 * max(now['num_workers'], 1))}")
            reasons.append(f"more workers: {cores} CPUs are usable, {current} uses {now['num_workers']}")
        else:
            reasons.append(
                f"the workers already use all {cores} CPUs: cheaper transforms, smaller images or more "
                "CPUs are what is left"
            )
    else:
        pick = now
        reasons.append(
            f"{current} keeps up: {now['batches_per_s']:.1f} batches/s from the loader, "
            f"{model_bps:.1f} batches/s taken by the model"
        )
    epoch_s = full_batches / pick["batches_per_s"]
    restart = pick["first_batch_e2_s"]
    if not pick["persistent_workers"] and pick["num_workers"] and restart > START_SHARE * epoch_s:
        overrides.append("loader.persistent_workers=true")
        reasons.append(
            f"slow epoch start: {restart:.2f} s each epoch to restart workers ({restart / epoch_s:.0%} "
            "of an "
            "epoch); persistent workers skip it, at the price of keeping their memory"
        )
    return {"profile": pick["profile"], "overrides": overrides, "reasons": reasons}


COLUMNS = [  # (key, header, format)
    ("profile", "profile", "{}"),
    ("num_workers", "workers", "{}"),
    ("prefetch_factor", "prefetch", "{}"),
    ("persistent_workers", "persistent", "{}"),
    ("plan_mib", "plan MiB", "{:.1f}"),
    ("in_flight_mib", "in flight MiB", "{:.1f}"),
    ("worker_start_s", "worker start s", "{:.2f}"),
    ("dataset_init_s", "dataset init s", "{:.2f}"),
    ("first_batch_e1_s", "1st batch e1 s", "{:.2f}"),
    ("first_batch_e2_s", "1st batch e2 s", "{:.2f}"),
    ("batches_per_s", "batches/s", "{:.1f}"),
    ("peak_pss_mib", "peak PSS MiB", "{:.0f}"),
]


def table(results: list[dict]) -> str:
    rows = [[h for _, h, _ in COLUMNS]]
    for r in results:
        if "refused" in r:
            rows.append([r["profile"], "refused: " + r["refused"]])
            continue
        rows.append([fmt.format(r[k]) if r.get(k) is not None else "-" for k, _, fmt in COLUMNS])
    full = [row for row in rows if len(row) == len(COLUMNS)]
    widths = [max(len(row[i]) for row in full) for i in range(len(COLUMNS))]
    lines = []
    for row in rows:
        if len(row) == len(COLUMNS):
            cells = "  ".join(c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True))
        else:  # a refused profile: why
            cells = row[1]
        lines.append(row[0].ljust(widths[0]) + "  " + cells)
    return "\n".join(lines)


def diagnose(cfg) -> dict:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    device = torch.device("cuda" if cfg.device.value != "cpu" and torch.cuda.is_available() else "cpu")
    if cfg.device.value == "cuda" and device.type != "cuda":
        raise UserError("device=cuda but no CUDA device is visible: use device=cpu or device=auto")
    rng.seed_everything(cfg.seed)
    current = HydraConfig.get().runtime.choices.get("loader", "balanced")
    overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith("loader=")]
    profiles = GlobalHydra.instance().config_loader().get_group_options("loader")
    available_mib, cores = psutil.virtual_memory().available / MiB, usable_cpus()
    shm_free, shm_size = memory.shm_space() or (None, None)  # where the batches in flight live (memory.py)
    began = time.perf_counter()
    train_set = parts.data_set(cfg, "train")
    build_s = time.perf_counter() - began
    results, collate = [], parts.collate(cfg, train_set)  # the batches as train.py collates them
    for name in profiles:
        profile_cfg = hydra.compose(config_name="config", overrides=overrides + [f"loader={name}"])
        log.info("measuring loader=%s", name)
        results.append(measure(name, profile_cfg.loader, train_set, device, cfg.seed, collate))
    model_bps = model_rate(cfg, train_set, cfg.loader.batch_size, device)
    weights = model_memory(cfg)
{% if cookiecutter.with_streams == "yes" %}
    samples = stream_records(train_set) if is_stream(train_set) else len(train_set)  # None: a stream without sizes
{% else %}
    samples = len(train_set)
{% endif %}
{% if cookiecutter.with_streams == "yes" %}
    full_batches = max((samples or 0) // cfg.loader.batch_size, 1)
{% else %}
    full_batches = max(samples // cfg.loader.batch_size, 1)
{% endif %}
    advice = recommend(results, current, model_bps, available_mib, cores, full_batches)
    report = {
        "machine": {
            "cpus": cores,
            "available_mib": available_mib,
            "shm_free_mib": shm_free / MiB if shm_free is not None else None,
            "shm_size_mib": shm_size / MiB if shm_size is not None else None,
            "device": str(device),
            "torch": torch.__version__,
            "python": sys.version.split()[0],
        },
        "data": {"train_samples": samples, "build_s": build_s, "full_epoch_batches": full_batches},
        "model_batches_per_s": model_bps,
        "model_memory_mib": weights,
        "current": current,
        "profiles": results,
        "recommendation": advice,
    }
    (run_dir / "doctor.json").write_text(json.dumps(report, indent=2))
    print(table(results))
    print(
        f"\nmodel ({cfg.model._target_.rsplit('.', 1)[-1]} on {device}): {model_bps:.1f} batches/s; "
        f"{available_mib:.0f} MiB available, {cores} CPUs; dataset built in {build_s:.2f} s"
    )
{% if cookiecutter.with_fsdp == "yes" %}
    fsdp_line = ", ".join(f"{mib:.1f} on {w}" for w, mib in weights["fsdp_per_rank"].items())
    print(
        f"model memory per rank: parameters {weights['parameters']:.1f} MiB + gradients {weights['gradients']:.1f} + "
        f"optimizer state {weights['optimizer_state']:.1f} = {weights['ddp_per_rank']:.1f} MiB under DDP; "
        f"parallel=fsdp: {fsdp_line} ranks"
    )
{% else %}
    print(
        f"model memory per rank: parameters {weights['parameters']:.1f} MiB + gradients {weights['gradients']:.1f} + "
        f"optimizer state {weights['optimizer_state']:.1f} = {weights['ddp_per_rank']:.1f} MiB under DDP"
    )
{% endif %}
    if shm_free is not None:
        print(f"{memory.SHM_DIR}: {shm_free / MiB:.1f} MiB free of {shm_size / MiB:.1f} MiB (batches in flight)")
    for r in results:
        if r.get("budget_change"):
            print(f"{r['profile']}: {r['budget_change']}")
    line = " ".join([f"loader={advice['profile']}", *advice["overrides"]])
    print(f"recommendation: {line}\n  - " + "\n  - ".join(advice["reasons"]))
    print(f"written: {run_dir / 'doctor.json'}")
    return report


def conf_dir() -> Path:
    """The project's Hydra config: `./conf` (run from the project root, as train.py is), else the conf/ beside
    this package in a source checkout. An installed package holds no conf/ of its own."""
    for folder in (Path.cwd() / "conf", Path(__file__).resolve().parents[1] / "conf"):
        if (folder / "config.yaml").is_file():
            return folder
    raise UserError(
        f"no conf/config.yaml in {str(Path.cwd())!r}: run the doctor from your project's root, "
        "the folder holding train.py and conf/"
    )


def run(cfg) -> None:
    try:
        diagnose(cfg)
    except Exception as e:
        error = find_user_error(e) or monitor.worker_death(e)
        if error is None:
            raise
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


def main() -> None:
    try:
        folder = conf_dir()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    schema.register()  # the schema conf/config.yaml lists first
    hydra.main(config_path=str(folder), config_name="config", version_base="1.3")(run)()


if __name__ == "__main__":
    main()
