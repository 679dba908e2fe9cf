"""P3: train.py's step rate vs a bare hand-written loop on the same model, data and loader.

    python -m benchmarks.p3_train_overhead

Both run EPOCHS epochs of the default config (SmallCNN on the shapes data, loader=balanced, SGD) in
their own process, timed the same way: samples/s from asking for an epoch's first batch to the end
of its last step, validation excluded. The bare loop has no scheduler, logging, health monitor,
checkpoints or deterministic kernels; it normalizes the uint8 batches the same way (data.normalize)
and reads the loss never. The pair runs ROUNDS times in turns; the best epoch after the first (which
includes the workers' start) of each counts, so that a moment when another job takes a core does not
decide the result; the spread over rounds is printed too. A ratio near 1 means train.py's logging,
health samples, checkpoints and exact-resume bookkeeping cost next to nothing per step.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# process.omp_wait_policy=passive, which train.py sets before torch loads: exported for both loops alike
PASSIVE = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ}
EPOCHS, ROUNDS = 3, 3


def bare() -> float:
    """The loop one would write by hand; same model, optimizer settings, loader and data as the default config."""
    import torch
    import torch.nn.functional as F
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from {{ cookiecutter.package }}.engine import parts, schema
    from {{ cookiecutter.package }}.engine.device import input_transform
    from {{ cookiecutter.package }}.engine.loader import TrainLoader, resolve_settings

    schema.register()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"epochs={EPOCHS}"])
    torch.manual_seed(cfg.seed)
    loader = TrainLoader(instantiate(cfg.data.train), resolve_settings(cfg.loader, "cpu"), seed=cfg.seed)
    model = instantiate(cfg.model, num_classes=cfg.data.num_classes)
    optimizer = parts.optimizer(cfg.optim, model)  # train.py's: its parameter groups, no weight decay on norms
    prepare = input_transform(cfg.data, torch.device("cpu"))
    rates = []
    for _ in range(cfg.epochs):
        model.train()
        samples, began = 0, time.perf_counter()
        for x, y in loader:
            loss = F.cross_entropy(model(prepare(x)), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            samples += len(y)
        rates.append(samples / (time.perf_counter() - began))
    return max(rates[1:])


def train_py() -> float:
    with tempfile.TemporaryDirectory() as run_dir:
        subprocess.run(
            [sys.executable, "train.py", f"epochs={EPOCHS}", "progress=false", f"hydra.run.dir={run_dir}"],
            cwd=ROOT,
            env=PASSIVE,
            check=True,
            capture_output=True,
        )
        lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
        return max(json.loads(line)["samples_per_s"] for line in lines[1:])


def main() -> None:
    if sys.argv[1:] == ["--bare"]:
        print(json.dumps(bare()))
        return
    trains, bares = [], []
    for _ in range(ROUNDS):
        trains.append(train_py())
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.p3_train_overhead", "--bare"],
            cwd=ROOT,
            env=PASSIVE,
            check=True,
            capture_output=True,
            text=True,
        )
        bares.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(
        f"P3 training step rate, default config (SmallCNN, shapes as uint8 batches, loader=balanced), samples/s, "
        f"best epoch of 2-{EPOCHS} per round, {ROUNDS} rounds in turns"
    )
    print(f"{'loop':<10} {'best':>8} {'rounds':>24}")
    for name, rates in (("train.py", trains), ("bare", bares)):
        print(f"{name:<10} {max(rates):>8.1f} {' '.join(f'{r:.1f}' for r in rates):>24}")
    print(f"train.py / bare = {max(trains) / max(bares):.3f} (best against best; 1 = no cost over the bare loop)")


if __name__ == "__main__":
    main()
