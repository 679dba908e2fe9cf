"""Experiment trackers besides the run folder's own files (`logger.use`): MLflow and Weights & Biases.

RunLog hands every tracker the Python floats it writes to steps.jsonl and metrics.jsonl, so no tracker reads a device
tensor. The calls go through a queue to one background thread, which sends whatever has piled up in one batch: a slow
tracking server delays that thread, never the step. Only the start (the tracked run's id, which every checkpoint keeps
so that a resume logs into the same tracked run) and the end (the queue drained) wait, each at most
`logger.timeout_s`. Rank 0 alone builds trackers.
"""

from __future__ import annotations

import importlib
import json
import logging
import queue
import re
import threading
import time
import urllib.request
import uuid
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import OmegaConf

from . import resume
from .errors import UserError, reason
from .schema import flatten

log = logging.getLogger("train")

LOCAL_MLFLOW = "mlflow.db"  # logger.mlflow.on_unreachable=local: a database in the run folder, with the run's files


def check_packages(cfg) -> None:
    """Each tracker of `logger.use` importable, else one line naming the pip extra (named after it)."""
    for name in [name for name in cfg.logger.use if name in REMOTE]:
        try:
            importlib.import_module(name)
        except ImportError:
            raise UserError(
                f"logger.use has {name} but the {name} package is not installed: "
                f'pip install -e ".[{name}]" (or choose another logger, e.g. logger=tensorboard)'
            ) from None


def start(cfg, run_dir: Path, ckpt: dict | None) -> Tracking | None:
    """The trackers of `logger.use` that live outside the run folder, started; None when there are none. `ckpt`: the
    checkpoint a resume loads, whose `tracking` ids say which tracked runs to continue, and whose step and changes
    (resume_strict=false) the tracked run is told (`note`: the first step this run logs, and that text)."""
    use = [name for name in cfg.logger.use if name in REMOTE]  # their packages importable: checked (`check_packages`)
    if not use:
        return None
    saved = (ckpt or {}).get("tracking") or {}
    note = None
    if ckpt is not None:
        step = ckpt["step"] + 1
        changed = resume.changes(ckpt, cfg)
        said = f"resumed at step {step}"
        note = step, f"{said}, changed (resume_strict=false): {resume.describe(changed)}" if changed else said
    params = flatten(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))
    sweep = None  # in a multirun (-m, Optuna) the sweep folder's name: its jobs share an experiment, a W&B group
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        sweep = Path(HydraConfig.get().sweep.dir).name
    trackers = [REMOTE[name](cfg.logger, run_dir, sweep) for name in use]
    for tracker in trackers:
        tracker.start(params, saved.get(tracker.name), note)
    return Tracking(trackers, float(cfg.logger.timeout_s))


class Tracking:
    """The trackers behind one queue and thread: `log` never waits; `close` at most `timeout_s`, naming what is left."""

    def __init__(self, trackers: list, timeout_s: float):
        self.trackers, self.timeout_s, self.queue = trackers, timeout_s, queue.Queue()
        self.failed = set()  # names of the trackers whose errors were already reported: one warning each
        self.thread = threading.Thread(target=self._drain, name="trackers", daemon=True)
        self.thread.start()

    def log(self, step: int, figures: dict) -> None:
        """Python floats, or a picture ((H, W, 3) uint8 numpy) under its tag: queued, sent by the thread."""
        self.queue.put((step, figures))  # the caller's own dict, built for this call

    def _drain(self) -> None:
        batch = []
        while None not in batch:  # None: `close` put the last point before it
            batch = [self.queue.get()]  # waits for the first; then takes all that piled up while the last send ran
            while not self.queue.empty():  # this thread alone takes from the queue
                batch.append(self.queue.get())
            for tracker in self.trackers:
                self._call(tracker, "log", [point for point in batch if point is not None])

    def _call(self, tracker, method: str, *args) -> None:
        try:
            getattr(tracker, method)(*args)
        except Exception as e:  # a tracker's failure never stops training: the run folder's files stay complete
            if tracker.name not in self.failed:
                self.failed.add(tracker.name)
                log.warning("logger %s: %s failed (%s); training goes on", tracker.name, method, reason(e))

    def close(self, files: dict, finished: bool) -> None:
        """Drain the queue (at most timeout_s), then hand each tracker the checkpoint paths and end its run."""
        self.queue.put(None)
        self.thread.join(self.timeout_s)
        if self.thread.is_alive():
            log.warning(
                "logger: %d log points not sent after logger.timeout_s=%g s (the tracking server is slow or down); "
                "steps.jsonl and metrics.jsonl hold them all",
                self.queue.qsize(),
                self.timeout_s,
            )
            return
        for tracker in self.trackers:
            self._call(tracker, "finish", files, finished)


def picture(value) -> bool:
    return hasattr(value, "shape")  # a numpy array among the floats: Tracking.log's pictures


class Tracker:
    """One tracked run per training run: `start` makes it or, given the id a checkpoint kept, continues it; `log`
    sends a batch of (step, {name: float or picture}); `finish` hands it the checkpoint paths and ends it."""

    name = ""

    def __init__(self, cfg, run_dir: Path, sweep: str | None):
        self.cfg, self.run_dir, self.sweep = cfg[self.name], run_dir, sweep
        self.timeout_s = float(cfg.timeout_s)
        self.run_id = None  # the tracked run's id, once `start` made or found it


class MlflowTracker(Tracker):
    """Through MlflowClient (no global active run): parameters, metrics by step, pictures, the checkpoint paths as
    tags, and with `log_checkpoints` the files as artifacts."""

    name = "mlflow"

    def start(self, params: dict, saved_id: str | None, note: tuple[int, str] | None) -> None:
        uri = self.reachable(str(self.cfg.tracking_uri))
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(uri)
        run = None
        if saved_id is not None:
            try:
                run = self.client.get_run(saved_id)
            except Exception as e:
                log.warning("logger mlflow: the checkpoint's run %s is not at %s (%s): starting a new MLflow run",
                            saved_id, uri, type(e).__name__)  # fmt: skip
        if run is not None:
            self.run_id = saved_id
            said = f"continuing run {saved_id}"
            self.client.update_run(self.run_id, status="RUNNING")
            params = {k: v for k, v in params.items() if k not in run.data.params}  # keys added since; values fixed
        else:
            experiment = self.cfg.experiment_name or self.sweep or re.sub(r"^\d\d-\d\d-\d\d_", "", self.run_dir.name)
            found = self.client.get_experiment_by_name(experiment)
            try:
                number = found.experiment_id if found else self.client.create_experiment(experiment)
            except Exception:  # another job of the same sweep created it meanwhile
                number = self.client.get_experiment_by_name(experiment).experiment_id
            self.run_id = self.client.create_run(number, run_name=self.run_dir.name).info.run_id
            said = f"run {self.run_id} in experiment {experiment!r}"
        items = [
            Param(k[:250], json.dumps(v) if isinstance(v, (list, dict)) else str(v)[:6000]) for k, v in params.items()
        ]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 parameters per batch
            self.client.log_batch(self.run_id, params=items[i : i + 100])
        if note is not None:  # a resume (without ids: from an older checkpoint, or the tracking was off)
            self.client.set_tag(self.run_id, f"resume.step_{note[0]}", note[1][:5000])
        log.info("logger mlflow: %s at %s", said, uri)

    def reachable(self, uri: str) -> str:
        """`uri`, or for a server that does not answer within timeout_s: refuse, or the run folder's database."""
        if not uri.startswith(("http://", "https://")):
            return uri
        try:
            with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=self.timeout_s) as answer:
                answer.read()
            return uri
        except Exception as e:
            why = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
        if self.cfg.on_unreachable == "local":
            local = f"sqlite:///{(self.run_dir / LOCAL_MLFLOW).resolve()}"
            log.warning("logger mlflow: %s does not answer (%s): logging to %s instead", uri, why, local)
            return local
        raise UserError(
            f"logger.mlflow.tracking_uri={uri} does not answer within logger.timeout_s={self.timeout_s:g} s ({why}): "
            f"start the server, or logger.mlflow.on_unreachable=local to log to the run folder's {LOCAL_MLFLOW}"
        )

    def log(self, points: list) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = []
        for step, m in points:
            for key, value in m.items():
                if picture(value):
                    self.client.log_image(self.run_id, value, key=key.replace("/", "_"), step=step)
                else:
                    metrics.append(Metric(key, float(value), now, step))
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def finish(self, files: dict, finished: bool) -> None:
        for kind, path in files.items():
            self.client.set_tag(self.run_id, f"checkpoint.{kind}", str(path))
            if self.cfg.log_checkpoints:
                self.client.log_artifact(self.run_id, str(path), artifact_path="checkpoints")
        # a stopped run (signal, max_steps) is to be continued: KILLED until a resume sets it running again
        self.client.set_terminated(self.run_id, status="FINISHED" if finished else "KILLED")


class WandbTracker(Tracker):
    """`logger.wandb.mode`: online, offline, disabled; a resume continues the run (`resume="allow"`). Offline runs
    land in `<run folder>/wandb/`; `wandb sync` uploads them."""

    name = "wandb"

    def start(self, params: dict, saved_id: str | None, note: tuple[int, str] | None) -> None:
        import wandb  # the wandb extra's: imported where used

        self.image = wandb.Image  # for `log`
        try:
            self.run = wandb.init(
                mode=self.cfg.mode,
                project=self.cfg.project,
                entity=self.cfg.entity,
                group=self.sweep,
                name=self.run_dir.name,
                dir=str(self.run_dir),
                id=saved_id or uuid.uuid4().hex[:12],  # ours, not W&B's: it goes into the checkpoint
                resume="allow" if saved_id else None,
                config=params,
                settings=wandb.Settings(init_timeout=self.timeout_s, silent=True, console="off"),
                reinit="create_new",  # a multirun's jobs in one process: each its own run
            )
        except Exception as e:
            raise UserError(
                f"logger wandb: wandb.init failed ({reason(e)}): "
                "check `wandb login` and the network, or logger.wandb.mode=offline (then `wandb sync` later)"
            ) from None
        self.run_id = self.run.id
        if note is not None:
            # a changed run: the new values replace the old in the config, and what changed is kept beside them
            self.run.config.update({**params, f"resume/step_{note[0]}": note[1]}, allow_val_change=True)
        log.info("logger wandb: run %s (%s) in %s", self.run_id, self.cfg.mode, self.run_dir / "wandb")

    def log(self, points: list) -> None:
        for step, m in points:
            self.run.log({k: self.image(v) if picture(v) else v for k, v in m.items()}, step=step)

    def finish(self, files: dict, finished: bool) -> None:
        for kind, path in files.items():
            self.run.summary[f"checkpoint/{kind}"] = str(path)
        self.run.finish()  # a stopped run is resumed into the same W&B run: not marked failed


REMOTE = {tracker.name: tracker for tracker in (MlflowTracker, WandbTracker)}  # logger.use's outside the run folder
