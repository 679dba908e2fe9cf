"""P3: train.py's step rate vs a bare hand-written loop on the same model, data and loader.

    python -m benchmarks.p3_train_overhead

Both run EPOCHS epochs of the default config (SmallCNN on the shapes data, loader=balanced, SGD) in
their own process, timed the same way: samples/s from asking for an epoch's first batch to the end
of its last step, validation excluded. The bare loop has no scheduler, logging, health monitor,
checkpoints or deterministic kernels. The pair runs ROUNDS times in turns; the best epoch after the
first (which includes the workers' start) of each counts, so that a moment when another job takes a
core does not decide the result. The ratio train.py / bare is what the extras cost: 1.0 means nothing.
"""

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EPOCHS, ROUNDS = 3, 3


def bare() -> float:
    """The loop one would write by hand; same model, optimizer settings, loader and data as the default config."""
    import torch
    import torch.nn.functional as F
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from {{ cookiecutter.package }} import config
    from {{ cookiecutter.package }}.loader import TrainLoader, resolve_settings

    config.register()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"epochs={EPOCHS}"])
    torch.manual_seed(cfg.seed)
    loader = TrainLoader(instantiate(cfg.data.train), resolve_settings(cfg.loader, "cpu"), seed=cfg.seed)
    model = instantiate(cfg.model, num_classes=cfg.data.num_classes)
    optimizer = instantiate(cfg.optim)(model.parameters())
    rates = []
    for _ in range(cfg.epochs):
        model.train()
        samples, began = 0, time.perf_counter()
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            samples += len(y)
        rates.append(samples / (time.perf_counter() - began))
    return max(rates[1:])


def train_py() -> float:
    with tempfile.TemporaryDirectory() as run_dir:
        subprocess.run([sys.executable, "train.py", f"epochs={EPOCHS}", "progress=false", f"hydra.run.dir={run_dir}"],
                       cwd=ROOT, check=True, capture_output=True)
        lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
        return max(json.loads(line)["samples_per_s"] for line in lines[1:])


def main() -> None:
    if sys.argv[1:] == ["--bare"]:
        print(json.dumps(bare()))
        return
    best_train = best_bare = 0.0
    for _ in range(ROUNDS):
        best_train = max(best_train, train_py())
        out = subprocess.run([sys.executable, "-m", "benchmarks.p3_train_overhead", "--bare"], cwd=ROOT, check=True,
                             capture_output=True, text=True)
        best_bare = max(best_bare, json.loads(out.stdout.strip().splitlines()[-1]))
    ratio = best_train / best_bare
    print(f"P3 training step rate, default config (SmallCNN, shapes, loader=balanced), samples/s, best epoch of "
          f"2-{EPOCHS} over {ROUNDS} rounds")
    print(f"{'loop':<10} {'samples/s':>10}")
    print(f"{'train.py':<10} {best_train:>10.1f}")
    print(f"{'bare':<10} {best_bare:>10.1f}")
    print(f"ratio train.py / bare = {ratio:.3f}: the step rate left after train.py's scheduler, logging, monitor, "
          "checkpoints and deterministic kernels (1.0: they cost nothing)")


if __name__ == "__main__":
    main()
