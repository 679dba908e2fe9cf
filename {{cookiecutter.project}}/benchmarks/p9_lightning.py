"""P9: train.py against Lightning's Trainer on the same work, each as a user runs it.

    pip install -e ".[bench]"            # lightning among the extras
    python -m benchmarks.p9_lightning    # --passive: OMP_WAIT_POLICY=PASSIVE exported for both
                                         # --lean: Lightning without logger, checkpoints and sanity check

The default config (SmallCNN on the shapes, loader=balanced: batch 64, 2 persistent workers, SGD) for EPOCHS epochs:
`python train.py` with its defaults, and a LightningModule over the same model, data sets, optimizer settings and
normalization, with the loaders a Lightning user writes (DataLoader with shuffle, the same workers) and Trainer's
defaults (its logger, checkpoints, sanity check). Each runs in a process of its own started as a user starts it, the
environment without OMP_WAIT_POLICY. Samples/s over an epoch's training steps, validation left out; the best epoch
after the first (which includes the workers' start) counts in each run. The pair runs ROUNDS times, the order
alternating; the ratio of each round is printed, then their median and lowest.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EPOCHS, ROUNDS = 4, 5


def lightning_rate(lean: bool) -> float:
    """The Lightning run, in this process: the best epoch's training samples/s after the first. `lean`: its leanest
    loop (no logger, no checkpoints, no sanity validation)."""
    import lightning as L
    import torch
    import torch.nn.functional as F
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate
    from torch.utils.data import DataLoader

    from {{ cookiecutter.package }}.engine import parts, schema
    from {{ cookiecutter.package }}.engine.device import input_transform

    schema.register()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"epochs={EPOCHS}"])
    prepare = input_transform(cfg.data, torch.device("cpu"))  # data.normalize, as train.py applies it
    loader = {"batch_size": cfg.loader.batch_size, "num_workers": cfg.loader.num_workers, "persistent_workers": True}

    class Classifier(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = instantiate(cfg.model, num_classes=cfg.data.num_classes)

        def training_step(self, batch, index):
            x, y = batch
            loss = F.cross_entropy(self.model(prepare(x)), y)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, index):
            x, y = batch
            logits = self.model(prepare(x))
            self.log("val_loss", F.cross_entropy(logits, y))
            self.log("val_acc", (logits.argmax(1) == y).float().mean())

        def configure_optimizers(self):
            return parts.optimizer(cfg.optim, self.model)  # train.py's groups and settings

    class Rate(L.Callback):
        """Samples/s from an epoch's start to its last training step's end (validation comes after)."""

        def __init__(self):
            self.rates = []

        def on_train_epoch_start(self, trainer, module):
            self.began, self.samples = time.perf_counter(), 0

        def on_train_batch_end(self, trainer, module, outputs, batch, index):
            self.samples, self.ended = self.samples + len(batch[1]), time.perf_counter()

        def on_train_epoch_end(self, trainer, module):
            self.rates.append(self.samples / (self.ended - self.began))

    torch.manual_seed(cfg.seed)
    train = DataLoader(instantiate(cfg.data.train), shuffle=True, **loader)
    val = DataLoader(instantiate(cfg.data.val), **loader)
    rate = Rate()
    with tempfile.TemporaryDirectory() as folder:
        lean_only = {"logger": False, "enable_checkpointing": False, "num_sanity_val_steps": 0} if lean else {}
        trainer = L.Trainer(max_epochs=EPOCHS, accelerator="cpu", devices=1, default_root_dir=folder,
                            enable_progress_bar=False, callbacks=[rate], **lean_only)  # fmt: skip
        trainer.fit(Classifier(), train, val)
    return max(rate.rates[1:])


def train_py_rate(env: dict) -> float:
    with tempfile.TemporaryDirectory() as run_dir:
        command = [sys.executable, "train.py", f"epochs={EPOCHS}", "progress=false", f"hydra.run.dir={run_dir}"]
        subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True)
        lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
        return max(json.loads(line)["samples_per_s"] for line in lines[1:])


def lightning_run(env: dict, lean: bool) -> float:
    command = [sys.executable, "-m", "benchmarks.p9_lightning", "--lightning", *(["--lean"] if lean else [])]
    out = subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    if "--lightning" in sys.argv[1:]:
        print(json.dumps(lightning_rate("--lean" in sys.argv[1:])))
        return
    try:
        import lightning  # noqa: F401 - only whether it is there
    except ImportError:
        sys.exit('error: P9 compares against Lightning: pip install -e ".[bench]"')
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}  # as a user's shell has it
    if "--passive" in sys.argv[1:]:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    lean = "--lean" in sys.argv[1:]
    ratios = []
    for i in range(ROUNDS):
        runs = [("train.py", train_py_rate), ("lightning", lambda env: lightning_run(env, lean))]
        rates = dict((name, run(env)) for name, run in (runs if i % 2 == 0 else runs[::-1]))
        ratios.append(rates["train.py"] / rates["lightning"])
        print(f"round {i + 1}: train.py {rates['train.py']:.0f}, Lightning {rates['lightning']:.0f} samples/s, "
              f"ratio {ratios[-1]:.3f}", flush=True)  # fmt: skip
    print(f"P9 train.py / Lightning Trainer, default config, best epoch of 2-{EPOCHS}, {ROUNDS} rounds in turns"
          f"{' (OMP_WAIT_POLICY=PASSIVE for both)' if 'OMP_WAIT_POLICY' in env else ''}"
          f"{' (Lightning lean)' if lean else ''}: median "
          f"{statistics.median(ratios):.3f}, lowest {min(ratios):.3f}, highest {max(ratios):.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
