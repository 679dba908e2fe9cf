"""Callbacks: what a run does beside training, picked in `conf/callbacks/` (`python train.py
'callbacks=[sample_grid,early_stopping]'`) or added by config (`+callbacks.<name>._target_=<your class>`).

The hooks and what `run` offers are in engine/callbacks.py. None of these changes the run: weights with them on are
the weights without them.
"""

from __future__ import annotations

from omegaconf import OmegaConf

from .engine.checkpoint import improves
from .engine.errors import UserError
from .engine.schema import flatten


class EarlyStopping:
    """Stop once `monitor` (a metrics.jsonl figure: val_acc, val_loss, train_loss...) has not improved by more than
    `min_delta` for `patience` validations in a row (`mode` max: higher is better; min: lower is better). The best
    value and the count travel in every checkpoint: a resumed run stops at the same step."""

    def __init__(self, monitor: str = "val_acc", mode: str = "max", patience: int = 3, min_delta: float = 0.0):
        if mode not in ("max", "min") or patience < 1 or min_delta < 0:
            raise ValueError(f"mode must be max or min, patience >= 1, min_delta >= 0; got {mode}, {patience}, "
                             f"{min_delta}")  # fmt: skip
        self.monitor, self.mode, self.patience, self.min_delta = monitor, mode, patience, min_delta
        self.best: float | None = None
        self.waited = 0  # validations since the last improvement

    def on_validation_end(self, run, record: dict) -> str | None:
        if self.monitor not in record:
            figures = ", ".join(k for k in record if k == "train_loss" or k.startswith("val_"))
            raise UserError(f"callbacks: EarlyStopping's monitor {self.monitor} is not reported; pick one of {figures}")
        value = record[self.monitor]
        if improves(value, self.best, self.mode, self.min_delta):  # as best.pth judges, with min_delta
            self.best, self.waited = value, 0
        else:
            self.waited += 1
        if self.waited < self.patience:
            return None
        return f"{self.monitor} has not improved on {self.best} for {self.waited} validations"

    def state_dict(self) -> dict:
        return {"best": self.best, "waited": self.waited}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.waited = state["best"], state["waited"]


class HParams:
    """The run's config (each key flattened, as a number or a word) and its final figures (the last validation's
    train_loss and val_*) in TensorBoard's HParams tab, as the run `tb/hparams`: the runs of a sweep compare side by
    side (`tensorboard --logdir outputs/<sweep folder>`)."""

    def __init__(self):
        self.last: dict | None = None

    def on_validation_end(self, run, record: dict) -> None:
        self.last = record

    def on_run_end(self, run) -> None:
        if self.last is None:
            return
        # each key as a number, bool or word; lists and None as words (what the HParams tab takes)
        config = flatten(OmegaConf.to_container(run.cfg, resolve=True, enum_to_str=True))
        config = {k: v if isinstance(v, (int, float, bool, str)) else str(v) for k, v in config.items() if v != {}}
        figures = {f"hparams/{k}": v for k, v in self.last.items() if k == "train_loss" or k.startswith("val_")}
        run.runlog.hparams(config, figures)
