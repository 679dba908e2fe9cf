"""P3: train.py's step rate vs a bare hand-written loop on the same model, data and loader.

    python benchmarks/p3_train_overhead.py

Both run 2 epochs of the default config (SmallCNN on the shapes data, loader=balanced, SGD) in their
own process and report samples/s of epoch 2 (epoch 1 includes the workers' start), timed the same
way: from asking for the first batch to the end of the last step, validation excluded. The bare
loop has no scheduler, logging, health monitor, checkpoints or deterministic kernels. Goal:
train.py / bare >= 0.97. The pair runs ROUNDS (2) times in turns and the best of each counts.
"""

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ROUNDS = 2


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
        cfg = compose("config", overrides=["epochs=2"])
    torch.manual_seed(cfg.seed)
    loader = TrainLoader(instantiate(cfg.data.train), resolve_settings(cfg.loader, "cpu"), seed=cfg.seed)
    model = instantiate(cfg.model, num_classes=cfg.data.num_classes)
    optimizer = instantiate(cfg.optim)(model.parameters())
    rate = 0.0
    for _ in range(cfg.epochs):
        model.train()
        samples, began = 0, time.perf_counter()
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            samples += len(y)
        rate = samples / (time.perf_counter() - began)
    return rate  # the last epoch's


def train_py() -> float:
    with tempfile.TemporaryDirectory() as run_dir:
        subprocess.run([sys.executable, "train.py", "epochs=2", "progress=false", f"hydra.run.dir={run_dir}"],
                       cwd=ROOT, check=True, capture_output=True)
        lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
        return json.loads(lines[-1])["samples_per_s"]


def main() -> None:
    if sys.argv[1:] == ["--bare"]:
        print(json.dumps(bare()))
        return
    best_train = best_bare = 0.0
    for _ in range(ROUNDS):
        best_train = max(best_train, train_py())
        out = subprocess.run([sys.executable, __file__, "--bare"], cwd=ROOT, check=True, capture_output=True, text=True)
        best_bare = max(best_bare, json.loads(out.stdout.strip().splitlines()[-1]))
    ratio = best_train / best_bare
    print("P3 training step rate, default config (SmallCNN, shapes, loader=balanced), epoch 2 samples/s")
    print(f"{'loop':<10} {'samples/s':>10}")
    print(f"{'train.py':<10} {best_train:>10.1f}")
    print(f"{'bare':<10} {best_bare:>10.1f}")
    print(f"ratio train.py / bare = {ratio:.3f}  (goal >= 0.97: {'met' if ratio >= 0.97 else 'NOT met'})")


if __name__ == "__main__":
    main()
