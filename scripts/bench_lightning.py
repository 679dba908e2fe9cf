"""The generated train.py against PyTorch Lightning's Trainer on the same work, in turns.

    .venv/bin/python scripts/bench_lightning.py                      # bakes the template, 5 rounds, default config
    .venv/bin/python scripts/bench_lightning.py rng_mode=per_worker  # any train.py overrides, for both sides' data

Both sides train the generated project's SmallCNN on its shapes data with the same transforms (uint8 batches,
normalized in the step by the project's data.normalize), the same optimizer and warmup-cosine schedule, and the same
loader settings (loader=balanced: batch 64, 2 persistent workers, prefetch 2), for EPOCHS epochs with validation after
each. A side's figure is its best training epoch after the first, in samples/s, timed from the epoch's start to the end
of its last optimizer step (validation excluded): train.py's own `samples_per_s` in metrics.jsonl, and the same span
measured by a callback in Lightning (`on_train_epoch_start` to the last `on_train_batch_end`). Lightning runs with its
logger, checkpointing, progress bar and summary off and no sanity validation: its leanest loop. The sides alternate
(train.py first in odd rounds, Lightning first in even ones) so that a busy spell on the machine falls on both. Each
round prints its ratio; the last line gives the median and the lowest round.

`lightning` is a template development requirement only (requirements-dev.txt); the generated project never needs it.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from baked_project import bake, engine_and_config, run_apart, serve_apart

EPOCHS, ROUNDS = int(os.environ.get("BENCH_EPOCHS", "4")), int(os.environ.get("BENCH_ROUNDS", "5"))


def lightning_run(project: Path, overrides: list[str]) -> float:
    """In the baked project: Lightning's Trainer on what train.py's config composes to; returns the best rate."""
    import lightning as L
    import torch
    import torch.nn.functional as F
    from hydra.utils import instantiate
    from torch.utils.data import DataLoader

    engine, cfg = engine_and_config(project, [f"epochs={EPOCHS}", *overrides])
    torch.manual_seed(cfg.seed)
    train_set, val_set = instantiate(cfg.data.train), instantiate(cfg.data.val)
    prepare = engine.device.input_transform(cfg.data, torch.device("cpu"))
    steps_per_epoch = len(train_set) // cfg.loader.batch_size

    def loader(dataset, shuffle: bool) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=cfg.loader.batch_size,
            shuffle=shuffle,
            drop_last=shuffle,
            num_workers=cfg.loader.num_workers,
            prefetch_factor=cfg.loader.prefetch_factor,
            persistent_workers=cfg.loader.persistent_workers,
        )

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = instantiate(cfg.model)

        def training_step(self, batch, _):
            x, y = batch
            return F.cross_entropy(self.model(prepare(x)), y)

        def validation_step(self, batch, _):
            x, y = batch
            self.log("val_acc", (self.model(prepare(x)).argmax(1) == y).float().mean())

        def configure_optimizers(self):
            o = cfg.optim
            optimizer = torch.optim.SGD(
                self.parameters(), lr=o.lr, momentum=o.momentum, nesterov=o.nesterov, weight_decay=o.weight_decay
            )
            scheduler = instantiate(cfg.schedule)(optimizer, total_steps=EPOCHS * steps_per_epoch)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    class EpochClock(L.Callback):
        def __init__(self):
            self.rates, self.began, self.ended, self.samples = [], 0.0, 0.0, 0

        def on_train_epoch_start(self, trainer, module):
            self.began, self.samples = time.perf_counter(), 0

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.samples, self.ended = self.samples + len(batch[1]), time.perf_counter()

        def on_validation_start(self, trainer, module):  # after each training epoch (no sanity validation)
            if self.samples:
                self.rates.append(self.samples / (self.ended - self.began))
                self.samples = 0

    clock = EpochClock()
    trainer = L.Trainer(
        max_epochs=EPOCHS,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[clock],
    )
    trainer.fit(Module(), loader(train_set, True), loader(val_set, False))
    return max(clock.rates[1:])


def train_py_run(project: Path, overrides: list[str]) -> float:
    with tempfile.TemporaryDirectory() as run_dir:
        command = [sys.executable, "train.py", f"epochs={EPOCHS}", "progress=false", f"hydra.run.dir={run_dir}"]
        subprocess.run([*command, *overrides], cwd=project, check=True, capture_output=True)
        lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
        return max(json.loads(line)["samples_per_s"] for line in lines[1:])


def lightning_apart(project: Path, overrides: list[str]) -> float:
    return run_apart(__file__, "--lightning", project, overrides)  # Lightning in its own process, as train.py runs


def main() -> None:
    if serve_apart("--lightning", lightning_run):
        return
    overrides = sys.argv[1:]
    with tempfile.TemporaryDirectory() as tmp:
        project = bake(Path(tmp) / "bake")
        ratios = []
        print(f"train.py vs Lightning, {EPOCHS} epochs, best epoch after the first, samples/s; overrides: {overrides}")
        for r in range(ROUNDS):
            sides = [("train.py", train_py_run), ("lightning", lightning_apart)]
            rates = {name: run(project, overrides) for name, run in (sides if r % 2 == 0 else sides[::-1])}
            ratios.append(rates["train.py"] / rates["lightning"])
            print(
                f"round {r + 1}: train.py {rates['train.py']:.0f}, lightning {rates['lightning']:.0f}, "
                f"ratio {ratios[-1]:.3f}",
                flush=True,
            )
        print(f"train.py / lightning: median {statistics.median(ratios):.3f}, lowest {min(ratios):.3f}")


if __name__ == "__main__":
    main()
