"""P9 (auto): loader=auto against every shipped profile and a grid of settings, on four workloads made on the fly.

    python -m benchmarks.p9_auto                  # every workload, ROUNDS rounds
    python -m benchmarks.p9_auto --only io --rounds 1

Workloads (`Workload`, a data set of random images made in memory, plugged in as data.train like a user's own):
memory (cheap samples), cpu (each sample costs about CPU_MS of work in the worker), io (each read waits IO_MS, as a
slow disk or a network read does), large (LARGE_SIZE pixels a side under a tight loader.ram_budget_mib). Each setting
is a 3-epoch `python train.py` in a process of its own, as a user runs it: its steady samples/s (the median epoch after
the first, from metrics.jsonl), its end-to-end seconds (process start to exit, auto's trials included) and its peak
PSS (the monitor's largest reading). The settings of a round run in turns, the order reversed every other round; the
best of the grid is the grid setting with the highest median. Goals (issue 58): auto's steady speed >= 0.95 x the
best grid setting and >= every profile, >= 2 x throughput on io, peak PSS within the budget, trials <= 30 s.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

ROOT = Path(__file__).resolve().parents[1]
EPOCHS, ROUNDS = 3, 2
CPU_MS, IO_MS, LARGE_SIZE = 4, 10, 160
SAMPLES = {"memory": 6400, "cpu": 2560, "io": 1920, "large": 1280}  # an epoch of a few seconds on 2 cores
GRID = {"memory": (0, 1, 2, 4), "cpu": (0, 1, 2, 4), "io": (0, 2, 4, 8, 16), "large": (0, 1, 2, 4)}
PROFILES = ("memory-tight", "balanced", "throughput")


class Workload(Dataset):
    """`size` random uint8 images of `image_size` pixels a side with 4 labels; `cpu_ms` of work (sorting) or `io_ms`
    of waiting per sample."""

    def __init__(self, size: int, image_size: int = 32, cpu_ms: float = 0, io_ms: float = 0, seed: int = 0):
        self.size, self.image_size, self.cpu_ms, self.io_ms, self.seed = size, image_size, cpu_ms, io_ms, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        draw = np.random.default_rng([self.seed, index])  # the same image for a sample whatever the worker
        image = draw.integers(0, 256, (3, self.image_size, self.image_size), dtype=np.uint8)
        if self.cpu_ms:
            deadline = time.thread_time() + self.cpu_ms / 1000  # CPU time, not wall time: the work a decode does
            while time.thread_time() < deadline:
                np.sort(image.ravel()[:20_000].astype(np.float64))
        if self.io_ms:
            time.sleep(self.io_ms / 1000)
        return torch.from_numpy(image), int(index % 4)


def data_overrides(workload: str) -> list[str]:
    """The shapes config's data replaced by a Workload (train and validation), as a user's own data set plugs in."""
    size = LARGE_SIZE if workload == "large" else 32
    work = {"cpu": f"cpu_ms={CPU_MS}", "io": f"io_ms={IO_MS}"}.get(workload)
    out = []
    for split, count in (("train", SAMPLES[workload]), ("val", 256)):
        out += [f"data.{split}._target_=benchmarks.p9_auto.Workload", f"+data.{split}.size={count}"]
        out += [f"~data.{split}.{key}" for key in ("root", "split", "per_class", "image_size", "transform")]
{% if cookiecutter.with_photos == "yes" %}
        out.append(f"~data.{split}.decode")
{% endif %}
        out += [f"+data.{split}.image_size={size}"] + ([f"+data.{split}.{work}"] if work else [])
    return [*out, f"data.image_size={size}", "model.width=16"]


def run(workload: str, setting: list[str], budget: float | None) -> dict:
    """One 3-epoch train.py run: steady samples/s, end-to-end seconds, peak PSS, and auto's trials."""
    with tempfile.TemporaryDirectory() as folder:
        extra = [f"loader.ram_budget_mib={budget:.0f}"] if budget else []
        cmd = [sys.executable, "train.py", *data_overrides(workload), *setting, *extra, f"epochs={EPOCHS}",
               "progress=false", "checkpoint.keep=0", f"hydra.run.dir={folder}"]  # fmt: skip
        began = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        seconds = time.perf_counter() - began
        if proc.returncode:
            raise SystemExit(f"{' '.join(setting)} on {workload} failed:\n{proc.stderr[-3000:]}")
        epochs = [json.loads(line) for line in (Path(folder) / "metrics.jsonl").read_text().splitlines()]
        pick = Path(folder) / "loader_pick.json"
        picked = json.loads(pick.read_text()) if pick.is_file() else None
    return {
        "steady": statistics.median(e["samples_per_s"] for e in epochs[1:]),
        "seconds": seconds,
        "peak_pss_mib": max(e["pss_mib"] for e in epochs),
        "trials_s": picked["tuned_s"] if picked else None,
        "pick": picked["settings"] if picked else None,
    }


def settings(workload: str) -> dict[str, list[str]]:
    named = {"auto": ["loader=auto"], **{p: [f"loader={p}"] for p in PROFILES}}
    for w in GRID[workload]:
        named[f"grid w={w}"] = ["loader=balanced", f"loader.num_workers={w}"]
    return named


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=sorted(SAMPLES), action="append")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args()
    budget = None
    for workload in args.only or list(SAMPLES):
        if workload == "large":  # tight: a few batches of 64 x 3 x 160 x 160 bytes (4.7 MiB) above the process
            base = run(workload, ["loader=balanced", "loader.num_workers=0"], None)["peak_pss_mib"]
            budget = base + 120
        named, results = settings(workload), {}
        for r in range(args.rounds):
            order = list(named) if r % 2 == 0 else list(reversed(named))
            for name in order:
                results.setdefault(name, []).append(run(workload, named[name], budget if name == "auto" else None))
        report(workload, results, budget)
        budget = None


def report(workload: str, results: dict, budget: float | None) -> None:
    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name])

    print(f"\n{workload}: {EPOCHS} epochs, {len(next(iter(results.values())))} rounds; median [lowest-highest]")
    for name, runs in results.items():
        steady = [r["steady"] for r in runs]
        seconds = [r["seconds"] for r in runs]
        picks = {(r["pick"]["num_workers"], r["pick"]["prefetch_factor"]) for r in runs if r["pick"]}
        pick = "  picks " + ", ".join(f"num_workers={w} prefetch_factor={p}" for w, p in sorted(picks)) if picks else ""
        trials = f", trials {max(r['trials_s'] for r in runs):.1f} s" if runs[0]["trials_s"] is not None else ""
        print(f"  {name:14} {statistics.median(steady):7.0f} [{min(steady):.0f}-{max(steady):.0f}] samples/s  "
              f"{statistics.median(seconds):5.1f} [{min(seconds):.1f}-{max(seconds):.1f}] s end to end  "
              f"peak PSS {max(r['peak_pss_mib'] for r in runs):.0f} MiB{trials}{pick}")  # fmt: skip
    grid = max((n for n in results if n.startswith("grid")), key=lambda n: median(n, "steady"))
    auto = median("auto", "steady")
    lines = [
        f"auto / best grid ({grid}): {auto / median(grid, 'steady'):.2f} (goal >= 0.95)",
        *(f"auto / {p}: {auto / median(p, 'steady'):.2f} (goal >= 1)" for p in PROFILES),
        f"auto end to end / balanced: {median('auto', 'seconds') / median('balanced', 'seconds'):.2f} (goal <= 1)",
        f"auto's trials: {max(r['trials_s'] for r in results['auto']):.1f} s at most (goal <= 30)",
    ]
    if budget:
        lines.append(f"auto's peak PSS {max(r['peak_pss_mib'] for r in results['auto']):.0f} MiB, budget {budget:.0f}")
    print("  " + "\n  ".join(lines))


if __name__ == "__main__":
    main()
