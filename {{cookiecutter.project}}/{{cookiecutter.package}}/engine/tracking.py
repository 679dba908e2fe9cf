"""Experiment trackers besides the run folder's own files (`logger.use`): MLflow, Weights & Biases and CSV.

RunLog hands every tracker the Python floats it already writes to steps.jsonl and metrics.jsonl, so no tracker reads
a device tensor. The calls go through a queue to one background thread, which sends whatever has piled up in one
batch: a slow tracking server delays that thread, never the step. Only the start (the tracked run's id, which every
checkpoint keeps so that a resume logs into the same tracked run) and the end (the queue drained) wait, each for at
most `logger.timeout_s`. Rank 0 alone builds trackers.
"""

from __future__ import annotations

import csv
import importlib
import json
import logging
import os
import queue
import re
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import OmegaConf

from .errors import UserError
from .schema import TRACKERS

log = logging.getLogger("train")

PACKAGE = {"mlflow": "mlflow", "wandb": "wandb"}  # the import that each needs, and the pip extra named after it
LOCAL_MLFLOW = "mlflow.db"  # logger.mlflow.on_unreachable=local: a database in the run folder, with the run's files


def flatten(tree, prefix: str = "") -> dict:
    """The composed config as dotted keys: the tracked run's parameters."""
    flat = {}
    for name, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{name}."))
        else:
            flat[prefix + str(name)] = value
    return flat


def plain(value):
    """A config Enum's string (str() of a str Enum is its class and name)."""
    return value.value if isinstance(value, Enum) else value


def chosen(cfg) -> list[str]:
    """The names in `logger.use`, checked: known, and each one's package importable (else one line naming the extra)."""
    use = list(OmegaConf.select(cfg, "logger.use", default=None) or ["tensorboard"])
    for name in use:
        if name not in TRACKERS:
            raise UserError(f"logger.use: unknown logger {name!r}: pick from {', '.join(TRACKERS)}")
        if name in PACKAGE and not importable(PACKAGE[name]):
            raise UserError(
                f"logger.use has {name} but the {PACKAGE[name]} package is not installed: "
                f'pip install -e ".[{name}]" (or choose another logger, e.g. logger=tensorboard)'
            )
    return use


def importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def names(run_dir: Path) -> tuple[str, str | None]:
    """(this run's name, its sweep's name or None): the run folder, and in a multirun (-m, Optuna) the sweep folder,
    so that the jobs of one sweep share an MLflow experiment and a W&B group."""
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        return run_dir.name, Path(HydraConfig.get().sweep.dir).name
    return run_dir.name, None


def start(
    cfg, run_dir: Path, ckpt: dict | None, purge_step: int | None, note: tuple[int, str] | None
) -> Tracking | None:
    """The trackers of `logger.use` other than TensorBoard (RunLog keeps that), started; None when there are none.
    `ckpt`: the checkpoint a resume loads, whose `tracking` ids say which tracked runs to continue; `note`: (the first
    step this run logs, what the tracked run is told: the step, with resume_strict=false what changed)."""
    use = [name for name in chosen(cfg) if name != "tensorboard"]
    if not use:
        return None
    timeout = float(cfg.logger.timeout_s)
    saved = dict((ckpt or {}).get("tracking") or {})
    params = flatten(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))
    run_name, sweep = names(run_dir)
    trackers = []
    for name in use:
        if name == "csv":
            trackers.append(CsvTracker(run_dir, purge_step))
        elif name == "mlflow":
            trackers.append(MlflowTracker(cfg.logger.mlflow, run_dir, run_name, sweep, timeout))
        else:
            trackers.append(WandbTracker(cfg.logger.wandb, run_dir, run_name, sweep, timeout))
        trackers[-1].start(params, saved.get(name), note)
    return Tracking(trackers, timeout)


@dataclass
class Picture:
    step: int
    tag: str
    array: object  # (H, W, 3) uint8 numpy


class Tracking:
    """The trackers behind one queue and one thread. `log` never waits; `close` waits for the queue at most
    `timeout_s` and says what was not sent."""

    def __init__(self, trackers: list, timeout_s: float):
        self.trackers, self.timeout_s = trackers, timeout_s
        self.queue: queue.Queue = queue.Queue()
        self.failed: set[str] = set()  # trackers whose errors were already reported: one warning each
        self.thread = threading.Thread(target=self._drain, name="trackers", daemon=True)
        self.thread.start()

    def ids(self) -> dict:
        """{tracker: its tracked run's id}: what a checkpoint keeps (`tracking`)."""
        return {t.name: t.run_id for t in self.trackers if t.run_id is not None}

    def log(self, step: int, metrics: dict) -> None:
        """Python floats only (what steps.jsonl and metrics.jsonl hold): queued, sent by the thread."""
        self.queue.put((step, dict(metrics)))

    def image(self, step: int, tag: str, picture) -> None:
        """A picture, (H, W, 3) uint8 numpy: queued, sent by the thread to the trackers that take pictures."""
        self.queue.put(Picture(step, tag, picture))

    def _drain(self) -> None:
        done = False
        while not done:
            batch = [self.queue.get()]  # waits for the first; then takes all that piled up while the last send ran
            while True:
                try:
                    batch.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            done = batch[-1] is None
            points = [item for item in batch if item is not None and not isinstance(item, Picture)]
            pictures = [item for item in batch if isinstance(item, Picture)]
            for tracker in self.trackers:
                if points:
                    self._call(tracker, "log", points)
                for picture in pictures if hasattr(tracker, "image") else ():
                    self._call(tracker, "image", picture)

    def _call(self, tracker, method: str, *args) -> None:
        try:
            getattr(tracker, method)(*args)
        except Exception as e:  # a tracker's failure never stops training: the run folder's files stay complete
            if tracker.name not in self.failed:
                self.failed.add(tracker.name)
                log.warning("logger %s: %s failed (%s: %s); training goes on", tracker.name, method, type(e).__name__,
                            str(e).splitlines()[0][:200] if str(e) else "")  # fmt: skip

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


class CsvTracker:
    """`steps.csv` (step, loss, lr, grad_norm, a task's loss_<name> parts) and `metrics.csv` (one row per
    validation, a column per figure)."""

    name = "csv"
    run_id = None  # the files live in the run folder: nothing to continue elsewhere

    def __init__(self, run_dir: Path, purge_step: int | None):
        self.steps, self.metrics = run_dir / "steps.csv", run_dir / "metrics.csv"
        self.purge_step = purge_step

    def start(self, params: dict, saved_id, note: tuple[int, str] | None) -> None:
        self.rows = self._read(self.metrics)
        if self.purge_step is not None:  # resuming into the same folder: rows past the checkpoint go, as in jsonl
            self.rows = [r for r in self.rows if float(r["step"]) < self.purge_step]
            self._write(self.steps, [r for r in self._read(self.steps) if float(r["step"]) < self.purge_step])
            self._write(self.metrics, self.rows)

    @staticmethod
    def _read(path: Path) -> list[dict]:
        if not path.exists():
            return []
        with open(path, newline="") as f:
            return list(csv.DictReader(f))

    @staticmethod
    def _write(path: Path, rows: list[dict]) -> None:
        columns = list(dict.fromkeys(k for row in rows for k in row))
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, columns)
            writer.writeheader()
            writer.writerows(rows)

    def log(self, points: list) -> None:
        steps = [p for p in points if "train/loss" in p[1]]
        if steps:
            new = not self.steps.exists()
            parts = sorted({k.split("/", 1)[1] for _, m in steps for k in m if k.startswith("train/loss_")})
            if not new:  # a resume into the same folder: the header written first (the same task, the same parts)
                with open(self.steps, newline="") as f:
                    parts = [c for c in next(csv.reader(f), []) if c.startswith("loss_")]
            with open(self.steps, "a", newline="") as f:
                writer = csv.DictWriter(f, ["step", "loss", "lr", "grad_norm", *parts], extrasaction="ignore")
                if new:
                    writer.writeheader()
                for step, m in steps:
                    writer.writerow({"step": step, **{k.split("/", 1)[1]: v for k, v in m.items()}})
        epochs = [(step, m) for step, m in points if "train/loss" not in m]
        if epochs:  # few rows, columns that vary (mid-epoch lines): the file is written whole
            self.rows += [{"step": step, **{k.split("/", 1)[1]: v for k, v in m.items()}} for step, m in epochs]
            self._write(self.metrics, self.rows)

    def finish(self, files: dict, finished: bool) -> None:
        pass


class MlflowTracker:
    """One MLflow run per training run, through MlflowClient (no global active run): parameters, metrics by step,
    the checkpoint paths as tags, and with `log_checkpoints` the files as artifacts."""

    name = "mlflow"

    def __init__(self, cfg, run_dir: Path, run_name: str, sweep: str | None, timeout_s: float):
        self.cfg, self.run_name, self.sweep, self.timeout_s = cfg, run_name, sweep, timeout_s
        self.local = f"sqlite:///{(run_dir / LOCAL_MLFLOW).resolve()}"
        self.run_id: str | None = None

    def start(self, params: dict, saved_id: str | None, note: tuple[int, str] | None) -> None:
        # every HTTP request bounded: MLflow's default retries with backoff can take minutes against a dead server
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(max(1, round(self.timeout_s))))
        uri = self.reachable(str(self.cfg.tracking_uri))
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(uri)
        if saved_id is not None:
            try:
                run = self.client.get_run(saved_id)
            except Exception as e:
                log.warning("logger mlflow: the checkpoint's run %s is not at %s (%s): starting a new MLflow run",
                            saved_id, uri, type(e).__name__)  # fmt: skip
            else:
                self.run_id = run.info.run_id
                self.client.update_run(self.run_id, status="RUNNING")
                known = run.data.params
                self._params({k: v for k, v in params.items() if k not in known})  # keys added since; values fixed
                self.client.set_tag(self.run_id, f"resume.step_{note[0]}", note[1][:5000])
                log.info("logger mlflow: continuing run %s at %s", self.run_id, uri)
                return
        experiment = self.cfg.experiment_name or self.sweep or re.sub(r"^\d\d-\d\d-\d\d_", "", self.run_name)
        self.run_id = self.client.create_run(self._experiment(experiment), run_name=self.run_name).info.run_id
        self._params(params)
        if note is not None:  # a resume from a checkpoint without ids (older, or the tracking was off)
            self.client.set_tag(self.run_id, f"resume.step_{note[0]}", note[1][:5000])
        log.info("logger mlflow: run %s in experiment %r at %s", self.run_id, experiment, uri)

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
        if plain(self.cfg.on_unreachable) == "local":
            log.warning("logger mlflow: %s does not answer (%s): logging to %s instead", uri, why, self.local)
            return self.local
        raise UserError(
            f"logger.mlflow.tracking_uri={uri} does not answer within logger.timeout_s={self.timeout_s:g} s ({why}): "
            f"start the server, or logger.mlflow.on_unreachable=local to log to the run folder's {LOCAL_MLFLOW}"
        )

    def _experiment(self, name: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(name)
        except Exception:  # another job of the same sweep created it meanwhile
            return self.client.get_experiment_by_name(name).experiment_id

    def _params(self, params: dict) -> None:
        from mlflow.entities import Param

        items = [
            Param(k[:250], json.dumps(v) if isinstance(v, (list, dict)) else str(v)[:6000]) for k, v in params.items()
        ]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 parameters per batch
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def log(self, points: list) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, step) for step, m in points for k, v in m.items()]
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def image(self, picture: Picture) -> None:
        self.client.log_image(self.run_id, picture.array, key=picture.tag.replace("/", "_"), step=picture.step)

    def finish(self, files: dict, finished: bool) -> None:
        for kind, path in files.items():
            self.client.set_tag(self.run_id, f"checkpoint.{kind}", str(path))
            if self.cfg.log_checkpoints:
                self.client.log_artifact(self.run_id, str(path), artifact_path="checkpoints")
        # a stopped run (signal, max_steps) is to be continued: KILLED until a resume sets it running again
        self.client.set_terminated(self.run_id, status="FINISHED" if finished else "KILLED")


class WandbTracker:
    """One W&B run per training run (`logger.wandb.mode`: online, offline, disabled); the checkpoint keeps its id and
    a resume continues it (`resume="allow"`). Offline runs land in `<run folder>/wandb/`; `wandb sync` uploads them."""

    name = "wandb"

    def __init__(self, cfg, run_dir: Path, run_name: str, sweep: str | None, timeout_s: float):
        self.cfg, self.run_dir, self.run_name, self.sweep, self.timeout_s = cfg, run_dir, run_name, sweep, timeout_s
        self.run_id: str | None = None

    def start(self, params: dict, saved_id: str | None, note: tuple[int, str] | None) -> None:
        import wandb

        settings = wandb.Settings(init_timeout=self.timeout_s, silent=True, console="off")
        try:
            self.run = wandb.init(
                mode=plain(self.cfg.mode),
                project=self.cfg.project,
                entity=self.cfg.entity,
                group=self.sweep,
                name=self.run_name,
                dir=str(self.run_dir),
                id=saved_id or uuid.uuid4().hex[:12],  # ours, not W&B's: it goes into the checkpoint
                resume="allow" if saved_id else None,
                config=params,
                settings=settings,
                reinit="create_new",  # a multirun's jobs in one process: each its own run
            )
        except Exception as e:
            raise UserError(
                f"logger wandb: wandb.init failed ({type(e).__name__}: {str(e).splitlines()[0][:200]}): "
                "check `wandb login` and the network, or logger.wandb.mode=offline (then `wandb sync` later)"
            ) from None
        self.run_id = self.run.id
        if note is not None:
            # a changed run: the new values replace the old in the config, and what changed is kept beside them
            self.run.config.update({**params, f"resume/step_{note[0]}": note[1]}, allow_val_change=True)
        log.info("logger wandb: run %s (%s) in %s", self.run_id, plain(self.cfg.mode), self.run_dir / "wandb")

    def log(self, points: list) -> None:
        for step, metrics in points:
            self.run.log(metrics, step=step)

    def image(self, picture: Picture) -> None:
        import wandb  # the wandb extra's: imported where used, as start() does

        self.run.log({picture.tag: wandb.Image(picture.array)}, step=picture.step)

    def finish(self, files: dict, finished: bool) -> None:
        for kind, path in files.items():
            self.run.summary[f"checkpoint/{kind}"] = str(path)
        self.run.finish()  # a stopped run is resumed into the same W&B run: not marked failed
