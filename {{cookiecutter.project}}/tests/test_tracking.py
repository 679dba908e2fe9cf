"""Trackers (engine/tracking.py, conf/logger/): MLflow against a real `mlflow server` on 127.0.0.1, W&B offline read
back from its run files, CSV; a stopped and resumed run continues the same tracked run, with every point once."""

import csv
import http.server
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from tests.helpers import PROJECT, RNG_DATA, load_ckpt, read_jsonl, run_train

# 3 epochs of 12 steps (200 samples, batch 16), a line per step: the stop at step 17 falls mid-epoch
DATA = [*RNG_DATA, "epochs=3", "log_every_steps=1"]
STOP = 17


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flat(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def expected_points(*run_dirs: Path) -> dict:
    """{metric: [(step, value)]} from steps.jsonl and metrics.jsonl of the runs, in order: what a tracker must hold."""
    points = {}
    for run_dir in run_dirs:
        for r in read_jsonl(run_dir / "steps.jsonl"):
            for k in ("loss", "lr", "grad_norm"):
                if k in r:
                    points.setdefault(f"train/{k}", []).append((r["step"], r[k]))
        for r in read_jsonl(run_dir / "metrics.jsonl"):
            for k, v in r.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
                    points.setdefault(f"epoch/{k}", []).append((r["step"], float(v)))
    return points


def stop_and_resume(tmp_path, *overrides, keep_ids: bool = True) -> tuple[Path, Path]:
    first, second = tmp_path / "first", tmp_path / "second"
    run_train(first, *DATA, f"max_steps={STOP}", *overrides)
    ckpt = first / "checkpoints/last.pth"
    if not keep_ids:  # negative control: a checkpoint without the tracked run's ids (as one from before this feature)
        state = load_ckpt(ckpt)
        assert state.pop("tracking")
        torch.save(state, ckpt)
    run_train(second, *DATA, f"resume={ckpt}", *overrides)
    return first, second


@pytest.fixture(scope="module")
def csv_run(tmp_path_factory) -> Path:
    """One epoch with logger=csv and clipping: the CSV files beside the jsonl ones."""
    run_dir = tmp_path_factory.mktemp("csv")
    run_train(run_dir, *DATA, "epochs=1", "logger=csv", "optim.grad_clip=1.0")
    return run_dir


# --- bad input: one line, exit 2, no hang


@pytest.mark.slow  # the fast tier stays under 240 s on two cores (issue 50 item 7)
def test_a_missing_package_is_one_line_naming_the_extra(tmp_path, csv_run):
    """A stand-in `mlflow` module that fails to import, as when the package is not installed."""
    (tmp_path / "mlflow.py").write_text("raise ImportError(\"No module named 'mlflow'\")\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{PROJECT}"}
    cmd = [sys.executable, "train.py", *DATA, "logger=mlflow", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.run(cmd, cwd=PROJECT, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        'error: logger.use has mlflow but the mlflow package is not installed: pip install -e ".[mlflow]" '
        "(or choose another logger, e.g. logger=tensorboard)"
    ]
    assert not (tmp_path / "run").exists()  # refused before Hydra wrote anything
    # control: without the stand-in on the path, a logger choice runs (the same DATA, logger=csv: csv_run)
    assert (csv_run / "steps.csv").exists() and load_ckpt(csv_run / "checkpoints/last.pth")["step"] == 12


@pytest.mark.slow  # about 15 s (mlflow's import): the fast tier's tracker refusal is the missing package above
def test_an_unreachable_server_is_refused_in_one_line(tmp_path):
    pytest.importorskip("mlflow", reason='the mlflow extra is not installed: pip install -e ".[mlflow]"')
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    proc = run_train(tmp_path / "run", *DATA, "logger=mlflow", f"logger.mlflow.tracking_uri={uri}", expect=2)
    assert time.monotonic() - started < 60  # refused at once (connection refused), not after MLflow's retries
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: logger.mlflow.tracking_uri={uri} does not answer"), lines
    assert "logger.mlflow.on_unreachable=local" in lines[0]
    assert (
        not (tmp_path / "run" / "checkpoints" / "last.pth").exists() and not (tmp_path / "run" / "steps.jsonl").exists()
    )


def test_csv_rows_are_the_jsonl_lines(csv_run):
    with open(csv_run / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    lines = read_jsonl(csv_run / "steps.jsonl")
    assert [int(r["step"]) for r in rows] == [r["step"] for r in lines] == list(range(1, 13))
    assert [(float(r["loss"]), float(r["grad_norm"])) for r in rows] == [(r["loss"], r["grad_norm"]) for r in lines]
    with open(csv_run / "metrics.csv") as f:
        (row,) = list(csv.DictReader(f))
    (line,) = read_jsonl(csv_run / "metrics.jsonl")
    assert float(row["val_acc"]) == line["val_acc"] and int(row["step"]) == line["step"] == 12
    assert list((csv_run / "tb").glob("events.out.tfevents.*"))  # TensorBoard stays on with logger=csv


# --- MLflow: a real server


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """`mlflow server` on a free port of 127.0.0.1, its store and artifacts in a temp folder; stopped after."""
    pytest.importorskip("mlflow", reason='the mlflow extra is not installed: pip install -e ".[mlflow]"')
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    store = ["--backend-store-uri", f"sqlite:///{root}/store.db", "--artifacts-destination", str(root / "artifacts")]
    cmd = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
        *store,
    ]
    log = open(root / "server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    uri, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(uri + "/health", timeout=2) as answer:
                if answer.status == 200:
                    break
        except OSError:
            pass
        assert proc.poll() is None, (root / "server.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "mlflow server did not answer /health within 120 s"
        time.sleep(0.3)
    yield uri
    os.killpg(proc.pid, 15)
    proc.wait(timeout=30)
    log.close()


def mlflow_runs(uri: str, experiment_ids=None):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    ids = experiment_ids or [e.experiment_id for e in client.search_experiments()]
    return client, client.search_runs(ids)


@pytest.mark.slow
def test_mlflow_resume_continues_the_same_run(tmp_path, mlflow_server):
    name = f"resume-{tmp_path.name}"
    server = (f"logger.mlflow.tracking_uri={mlflow_server}", f"logger.mlflow.experiment_name={name}")
    overrides = ("logger=mlflow", *server, "logger.mlflow.log_checkpoints=true", "optim.grad_clip=1.0")
    first, second = stop_and_resume(tmp_path, *overrides)
    client, runs = mlflow_runs(mlflow_server)
    runs = [r for r in runs if client.get_experiment(r.info.experiment_id).name == name]
    assert len(runs) == 1, [r.info.run_id for r in runs]
    (run,) = runs
    assert run.info.run_id == load_ckpt(second / "checkpoints/last.pth")["tracking"]["mlflow"]
    assert run.info.status == "FINISHED"
    expected = expected_points(first, second)
    assert set(run.data.metrics) == set(expected)
    for key, points in expected.items():
        history = [(m.step, m.value) for m in sorted(client.get_metric_history(run.info.run_id, key),
                                                     key=lambda m: (m.step, m.timestamp))]  # fmt: skip
        assert history == points, key  # every log point and epoch once, no step repeated or missing
    assert [s for s, _ in expected["train/loss"]] == list(range(1, 37))
    composed = flat(load_ckpt(first / "checkpoints/last.pth")["config"])
    assert run.data.params == {k: json.dumps(v) if isinstance(v, list) else str(v) for k, v in composed.items()}
    assert run.data.tags[f"resume.step_{STOP + 1}"] == f"resumed at step {STOP + 1}"
    assert run.data.tags["checkpoint.last"] == str(second / "checkpoints/last.pth")
    assert {a.path for a in client.list_artifacts(run.info.run_id, "checkpoints")} == {
        "checkpoints/last.pth", "checkpoints/best.pth"}  # fmt: skip
    assert client.list_artifacts(run.info.run_id, "images")  # the sample grid (callbacks.SampleGrid), a picture


@pytest.mark.slow
def test_mlflow_without_the_stored_run_id_makes_two_runs(tmp_path, mlflow_server):
    """Negative control: the same stop and resume from a checkpoint without `tracking` gives a second MLflow run."""
    name = f"control-{tmp_path.name}"
    overrides = (
        "logger=mlflow",
        f"logger.mlflow.tracking_uri={mlflow_server}",
        f"logger.mlflow.experiment_name={name}",
    )
    stop_and_resume(tmp_path, *overrides, keep_ids=False)
    client, runs = mlflow_runs(mlflow_server)
    runs = [r for r in runs if client.get_experiment(r.info.experiment_id).name == name]
    assert len(runs) == 2
    steps = sorted(m.step for r in runs for m in client.get_metric_history(r.info.run_id, "train/loss"))
    assert steps == list(range(1, 37))  # split over two runs


class SlowProxy(http.server.ThreadingHTTPServer):
    """An HTTP proxy to the MLflow server that waits `delay_s` before forwarding each request: a slow server."""

    def __init__(self, target: str, delay_s: float):
        self.target, self.delay_s, self.requests = target, delay_s, 0
        super().__init__(("127.0.0.1", 0), SlowHandler)


class SlowHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _forward(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) or None
        if not self.path.endswith("/health"):
            self.server.requests += 1
            time.sleep(self.server.delay_s)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
        request = urllib.request.Request(self.server.target + self.path, body, headers, method=self.command)
        try:
            with urllib.request.urlopen(request, timeout=60) as answer:
                status, data, kind = answer.status, answer.read(), answer.headers.get("Content-Type", "")
        except urllib.error.HTTPError as e:
            status, data, kind = e.code, e.read(), e.headers.get("Content-Type", "")
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PATCH = do_DELETE = _forward


@pytest.mark.slow
def test_a_slow_server_does_not_block_the_step(tmp_path, mlflow_server):
    """Each request to the server waits 0.5 s: the steps do not (the queue sends in the background)."""
    proxy = SlowProxy(mlflow_server, delay_s=0.5)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    uri = f"http://127.0.0.1:{proxy.server_address[1]}"
    slow, plain = tmp_path / "slow", tmp_path / "plain"
    run_train(plain, *DATA, "epochs=2")
    run_train(slow, *DATA, "epochs=2", "logger=mlflow", f"logger.mlflow.tracking_uri={uri}",
              f"logger.mlflow.experiment_name=slow-{tmp_path.name}", "logger.timeout_s=120")  # fmt: skip
    proxy.shutdown()
    train_s = {d.name: sum(r["epoch_time_s"] for r in read_jsonl(d / "metrics.jsonl")) for d in (slow, plain)}
    # 24 log points and 2 epochs: logging each in the step would add 26 x 0.5 s = 13 s to the training time
    print(f"training time: {train_s['plain']:.2f} s without a tracker, {train_s['slow']:.2f} s against a server "
          f"answering in 0.5 s ({proxy.requests} requests)")  # fmt: skip
    assert train_s["slow"] < train_s["plain"] + 5, train_s
    client, runs = mlflow_runs(mlflow_server)
    (run,) = [r for r in runs if client.get_experiment(r.info.experiment_id).name == f"slow-{tmp_path.name}"]
    assert len(client.get_metric_history(run.info.run_id, "train/loss")) == 24  # all sent by the end, none lost


@pytest.mark.slow
def test_an_unreachable_server_falls_back_to_the_run_folder(tmp_path):
    pytest.importorskip("mlflow", reason='the mlflow extra is not installed: pip install -e ".[mlflow]"')
    uri = f"http://127.0.0.1:{free_port()}"
    proc = run_train(tmp_path, *DATA, "max_steps=3", "logger=mlflow", f"logger.mlflow.tracking_uri={uri}",
                     "logger.mlflow.on_unreachable=local")  # fmt: skip
    assert f"{uri} does not answer" in proc.stdout + proc.stderr
    # MLflow's requests bounded by process.setup, which names what it exported in the run's log
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES=2, MLFLOW_HTTP_REQUEST_TIMEOUT=30" in (tmp_path / "train.log").read_text()
    client, runs = mlflow_runs(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert len(runs) == 1 and len(client.get_metric_history(runs[0].info.run_id, "train/loss")) == 3


# --- W&B offline, read back from its run files


def wandb_records(run_dir: Path) -> list[tuple[str, object]]:
    """(run id, protobuf Record) for every record of every offline run under run_dir/wandb (LevelDB log format:
    32 KiB blocks of chunks, each with a 7-byte header: crc32, length, type 1 full / 2 first / 3 middle / 4 last)."""
    from wandb.proto import wandb_internal_pb2

    out = []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        data, pos, chunk = path.read_bytes(), 7, b""  # past W&B's own 7-byte file header
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
                pos += 32768 - pos % 32768
                continue
            _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            if length == 0 and kind == 0:
                break
            chunk, pos = chunk + data[pos + 7 : pos + 7 + length], pos + 7 + length
            if kind in (1, 4):
                record = wandb_internal_pb2.Record()
                record.ParseFromString(chunk)
                out.append((path.stem.removeprefix("run-"), record))
                chunk = b""
    return out


def wandb_history(records) -> dict:
    points = {}
    for _, r in records:
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            pictures = tuple(k[: -len("_type")] for k in items if k.endswith("/_type"))  # e.g. the sample grid
            for k, v in items.items():
                if not k.startswith("_") and not k.startswith(pictures or ("\0",)):
                    points.setdefault(k, []).append((items["_step"], float(v)))
    return points


@pytest.mark.slow
def test_wandb_offline_resume_continues_the_same_run(tmp_path):
    pytest.importorskip("wandb", reason='the wandb extra is not installed: pip install -e ".[wandb]"')
    first, second = stop_and_resume(tmp_path, "logger=wandb", "logger.wandb.mode=offline")
    records = wandb_records(first) + wandb_records(second)
    ids = {run_id for run_id, _ in records}
    assert ids == {load_ckpt(second / "checkpoints/last.pth")["tracking"]["wandb"]}  # one W&B run
    assert wandb_history(records) == expected_points(first, second)  # every point once, in order
    (run,) = [r.run for _, r in wandb_records(first) if r.WhichOneof("record_type") == "run"]
    config = {u.key: json.loads(u.value_json) for u in run.config.update if u.key != "_wandb"}
    assert config == flat(load_ckpt(first / "checkpoints/last.pth")["config"])
    assert list((first / "wandb").glob("offline-run-*/files/media/images/**/*.png"))  # the sample grid, a picture
    # control: without the stored id, the resumed run is a second W&B run
    shutil.rmtree(second)
    _, again = stop_and_resume(tmp_path / "control", "logger=wandb", keep_ids=False)
    assert len({run_id for run_id, _ in wandb_records(tmp_path / "control/first") + wandb_records(again)}) == 2


@pytest.mark.slow
def test_a_multirun_gives_one_mlflow_run_per_job_grouped_by_the_sweep(tmp_path, mlflow_server):
    sweep = tmp_path / "my-sweep"
    server = f"logger.mlflow.tracking_uri={mlflow_server}"
    cmd = [sys.executable, "train.py", "-m", "seed=0,1", *RNG_DATA, "epochs=1", "logger=mlflow", server,
           f"hydra.sweep.dir={sweep}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=PROJECT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    client, runs = mlflow_runs(mlflow_server)
    grouped = [r for r in runs if client.get_experiment(r.info.experiment_id).name == "my-sweep"]
    assert sorted(r.info.run_name for r in grouped) == sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert len(grouped) == 2 and all(r.info.status == "FINISHED" for r in grouped)
    # a single run is not put in that experiment: the grouping comes from the sweep
    run_train(tmp_path / "single", *RNG_DATA, "epochs=1", "logger=mlflow", server)
    _, after = mlflow_runs(mlflow_server)
    assert len([r for r in after if client.get_experiment(r.info.experiment_id).name == "my-sweep"]) == 2
