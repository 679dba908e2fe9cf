"""Where a training step's CPU time goes: py-spy samples train.py's main process and its loader workers.

    .venv/bin/python scripts/profile_step.py                      # bakes the template, default config
    .venv/bin/python scripts/profile_step.py rng_mode=per_worker  # any train.py overrides

Main process: py-spy (a template development requirement) samples one `train.py epochs=EPOCHS` run RATE times a
second without pausing it, leaving out threads blocked in the kernel (the loop waiting for a batch); each sample
goes to the first category whose marker its stack holds, and the table gives milliseconds per optimizer step
(samples / RATE / steps). A worker's share: py-spy does not follow the DataLoader's forked workers, so each part of
making one batch (decode, transforms, seeding, collate, the hand-over, the RNG snapshot) is timed on its own in one
process, on the same data and transforms, best of ROUNDS. On two cores every worker millisecond is taken from the
training process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from baked_project import bake, engine_and_config, run_apart, serve_apart

EPOCHS, RATE = 3, 250

# (category, markers): a stack goes to the first category one of whose markers it contains
MAIN = [
    ("threads: health samples, TensorBoard writer", ("Thread._bootstrap",)),
    ("setup: config checks, dry step, build", ("CheckBeforeRun", "check (", "build (", "dry_step")),
    ("validation (evaluate)", ("evaluate (",)),
    ("checkpoint save", ("CheckpointPolicy.save", "torch/serialization")),
    ("backward", ("_engine_run_backward", "Tensor.backward")),
    ("optimizer step (SGD)", ("Optimizer", "SGD.step", "GradScaler.step")),
    ("schedule step", ("LRScheduler.step", "lr_scheduler")),
    ("forward + loss", ("Classification.loss", "Module._call_impl")),
    ("receiving batches (unpickle, fds)", ("rebuild_storage", "_rebuild", "recv_handle", "resource_sharer")),
    ("waiting for the next batch", ("TrainLoader.__iter__", "_next_data", "device_batches")),
    ("normalize (uint8 -> float)", ("Normalize.__call__", "PrepareBatch")),
    ("bookkeeping: meter, monitor, log points", ("EpochMeter", "Monitor", "log_step", "RunLog", "health-sample")),
    ("sampler and index queue", ("EpochBatchSampler", "_try_put_index", "Queue._feed", "queues.py")),
]
ROUNDS, BATCHES = 5, 10


def worker_parts(project: Path, overrides: list[str]) -> dict:
    """Milliseconds per batch of each part of a worker's work on the configured training data (run in the project)."""
    import pickle
    import time
    from multiprocessing.reduction import ForkingPickler

    from hydra.utils import instantiate
    from torch.utils.data import default_collate

    engine, cfg = engine_and_config(project, overrides)
    data, size = instantiate(cfg.data.train), cfg.loader.batch_size
    batches = [list(range(i * size, (i + 1) * size)) for i in range(BATCHES)]
    images = [[data.loader(str(data.paths[i])) for i in b] for b in batches]
    samples = [[(data.transform(im), int(data.labels[i])) for im, i in zip(ims, b)] for ims, b in zip(images, batches)]
    parts = {
        "decode (PIL)": lambda k: [data.loader(str(data.paths[i])) for i in batches[k]],
        "transforms (torchvision v2)": lambda k: [data.transform(im) for im in images[k]],
        "per-sample seeding (rng_mode=per_sample)": lambda k: [
            engine.rng.seed_sample(engine.rng.index_seed(engine.rng.epoch_base(0, 0), i)) for i in batches[k]
        ],
        "collate": lambda k: default_collate(samples[k]),
        "hand-over: shared memory + pickling": lambda k: ForkingPickler.dumps(
            engine.loader.map_tensors(engine.loader._for_the_queue, default_collate(samples[k]))
        ),
        "RNG snapshot (rng_mode=per_worker)": lambda k: pickle.dumps(engine.rng.capture()),
    }
    best = dict.fromkeys(parts, float("inf"))
    for _ in range(ROUNDS):
        for name, part in parts.items():
            began = time.perf_counter()
            for k in range(BATCHES):
                part(k)
            best[name] = min(best[name], (time.perf_counter() - began) / BATCHES * 1000)
    best["collate"] = max(0.0, best["collate"])
    best["hand-over: shared memory + pickling"] -= best["collate"]  # it collated again to have fresh tensors
    return best


def categorise(stack: str) -> str:
    if "Thread._bootstrap" not in stack and "train (train.py" not in stack:
        return "outside train(): imports, Hydra, exit"
    for name, markers in MAIN:
        if any(m in stack for m in markers):
            return name
    return "other"


def profile(project: Path, overrides: list[str]) -> tuple[Counter, int]:
    with tempfile.TemporaryDirectory() as tmp:
        raw, run_dir = Path(tmp) / "raw.txt", Path(tmp) / "run"
        command = ["train.py", f"epochs={EPOCHS}", "progress=false", f"hydra.run.dir={run_dir}", *overrides]
        spy = [sys.executable.replace("python", "py-spy"), "record", "--subprocesses", "--nonblocking"]
        subprocess.run(
            [*spy, "-r", str(RATE), "-f", "raw", "-o", str(raw), "--", sys.executable, *command],
            cwd=project,
            check=True,
            capture_output=True,
        )
        steps = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"]
        main = Counter()
        for line in raw.read_text().splitlines():
            stack, count = line.rsplit(" ", 1)
            main[categorise(stack)] += int(count)
        return main, steps


def main() -> None:
    if serve_apart("--worker-parts", worker_parts):
        return
    with tempfile.TemporaryDirectory() as tmp:
        project = Path(sys.argv[1]) if sys.argv[1:2] and Path(sys.argv[1]).is_dir() else bake(Path(tmp) / "bake")
        overrides = [a for a in sys.argv[1:] if "=" in a]
        counts, steps = profile(project, overrides)
        parts = run_apart(__file__, "--worker-parts", project, overrides)
    total = sum(counts.values())
    print(f"main process, ms per optimizer step: {steps} steps ({EPOCHS} epochs), py-spy at {RATE} Hz; {overrides}")
    for name, n in counts.most_common():
        print(f"  {name:<48} {n / RATE / steps * 1000:8.2f} ms  {100 * n / total:5.1f}%")
    print("a worker, ms per batch, each part timed alone in one process (best of 5 rounds of 10 batches)")
    for name, ms in parts.items():
        print(f"  {name:<48} {ms:8.2f} ms")


if __name__ == "__main__":
    main()
