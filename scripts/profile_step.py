"""Where a training step's CPU time goes: py-spy samples train.py's main process and its loader workers.

    .venv/bin/python scripts/profile_step.py                      # bakes the template, default config
    .venv/bin/python scripts/profile_step.py rng_mode=per_worker  # any train.py overrides

py-spy (a template development requirement) samples every process of one `train.py epochs=EPOCHS` run RATE times a
second, without pausing it, and leaves out threads blocked in the kernel (a loop waiting for a batch, a worker
waiting for indices): what remains is CPU time. Each sample is put in the first category whose marker its stack
holds, and the table gives CPU milliseconds per optimizer step (samples / RATE / steps) for the main process and
for the workers together. On two cores every worker millisecond is taken from the training process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parents[1]
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
    ("receiving batches (unpickle, fds)", ("rebuild_storage", "_rebuild", "recv_handle", "resource_sharer", "_get_data")),
    ("normalize (uint8 -> float)", ("Normalize.__call__", "PrepareBatch")),
    ("bookkeeping: meter, monitor, log points", ("EpochMeter", "Monitor", "log_step", "RunLog", "health-sample")),
    ("sampler and index queue", ("EpochBatchSampler", "_try_put_index", "Queue._feed", "queues.py")),
]
WORKER = [
    ("decode (PIL)", ("PIL/", "Image.open", "ImageFile.load", "Image.convert")),
    ("transforms (torchvision v2)", ("torchvision/transforms",)),
    ("per-sample seeding", ("seed_sample", "sample_seeds")),
    ("RNG snapshot (per_worker)", ("rng.py", "capture (")),
    ("collate + shared memory", ("collate", "share_memory_", "_for_the_queue", "InlineTensor")),
    ("sending batches (pickle, fds)", ("Queue.put", "_feed", "ForkingPickler", "reduce_storage", "resource_sharer")),
    ("index queue", ("_worker_loop", "Queue.get")),
]


def categorise(stack: str, table) -> str:
    if table is MAIN and "Thread._bootstrap" not in stack and "train (train.py" not in stack:
        return "outside train(): imports, Hydra, exit"
    for name, markers in table:
        if any(m in stack for m in markers):
            return name
    return "other"


def profile(project: Path, overrides: list[str]) -> tuple[Counter, Counter, int, int]:
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
        main, workers, main_pid = Counter(), Counter(), None
        for line in raw.read_text().splitlines():
            stack, count = line.rsplit(" ", 1)
            process = stack.split(";", 1)[0]
            main_pid = main_pid or process  # the first process py-spy reports is the one it started
            if process == main_pid:
                main[categorise(stack, MAIN)] += int(count)
            else:
                workers[categorise(stack, WORKER)] += int(count)
        return main, workers, steps, RATE


def bake(into: Path) -> Path:
    subprocess.run([sys.executable, "-m", "cookiecutter", str(TEMPLATE), "--no-input", "-o", str(into)], check=True)
    (project,) = into.iterdir()
    subprocess.run(  # data generation, before the profiled run
        [sys.executable, "train.py", "max_steps=1", "progress=false", f"hydra.run.dir={into}/warmup"],
        cwd=project,
        check=True,
        capture_output=True,
    )
    return project


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        project = Path(sys.argv[1]) if sys.argv[1:2] and Path(sys.argv[1]).is_dir() else bake(Path(tmp) / "bake")
        overrides = [a for a in sys.argv[1:] if "=" in a]
        main_counts, worker_counts, steps, rate = profile(project, overrides)
    print(f"CPU ms per optimizer step, {steps} steps ({EPOCHS} epochs), py-spy at {rate} Hz; overrides: {overrides}")
    for title, counts in (("main process", main_counts), ("loader workers (together)", worker_counts)):
        total = sum(counts.values())
        print(f"\n{title}: {total / rate / steps * 1000:.1f} ms per step")
        for name, n in counts.most_common():
            print(f"  {name:<48} {n / rate / steps * 1000:8.2f} ms  {100 * n / total:5.1f}%")


if __name__ == "__main__":
    main()
