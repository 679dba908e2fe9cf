"""Shared test helpers: run `train.py` for real (Hydra, DataLoader workers, files on disk) in a subprocess."""

import contextlib
import json
import os
import shlex
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch

from {{ cookiecutter.package }}.engine.loader import LoaderSettings
from tests.warm_train import WarmTrain

PROJECT = Path(__file__).resolve().parents[1]

WARM = []  # this pytest process's WarmTrain, once its first run has started it

# Bytes that open like a pickle of protocol 62: torch warns of the protocol before it refuses them. About one random
# file in 260 starts with a pickle's PROTO byte and a number above 5, which is how a run once saw three stderr lines.
NOT_A_PICKLE = b"\x80\x3e" + bytes(range(256)) * 16


# A dataset drawing from the workers' torch, numpy and python RNGs, plugged in like a user's own.
RNG_DATA = [
    "data.train._target_=tests.datasets.RngDrawingDataset",
    "~data.train.root",
    "~data.train.split",
    "~data.train.per_class",
    "~data.train.image_size",
    "~data.train.transform",
{% if cookiecutter.with_photos == "yes" %}
    "~data.train.decode",
{% endif %}
    "+data.train.size=200",
    "data.val._target_=tests.datasets.RngDrawingDataset",
    "~data.val.root",
    "~data.val.split",
    "~data.val.per_class",
    "~data.val.image_size",
    "~data.val.transform",
{% if cookiecutter.with_photos == "yes" %}
    "~data.val.decode",
{% endif %}
    "+data.val.size=64",
    "data.num_classes=4",
    "loader.batch_size=16",
    "progress=false",
]


def run_train(
    run_dir: Path,
    *overrides: str,
    expect: int = 0,
    timeout: int = 300,
    start_method: str | None = None,
    env: dict | None = None,
) -> subprocess.CompletedProcess:
    """`python train.py ...` in the project root, its outputs in `run_dir`; asserts the exit code. Started warm
    (tests/warm_train.py) unless the run needs a cold start or WARM_TRAIN=0. `start_method`:
    the workers are started that way (tests/start_method.py) instead of the platform's default; `env`: variables
    set for this run on top of the environment."""
    launcher = ["tests/start_method.py", start_method] if start_method else []
    cmd = [sys.executable, *launcher, "train.py", *overrides, f"hydra.run.dir={run_dir}"]
    env = {**os.environ, **(env or {})}
    server = None if start_method or env.get("WARM_TRAIN") == "0" else warm_server()
    if server is not None and server.fits(env):  # forked from a process that has imported torch (warm_train.py)
        proc = server.run(cmd[1:], env, timeout)
    else:
        proc = subprocess.run(cmd, cwd=PROJECT, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == expect, (
        f"exit {proc.returncode} != {expect} for {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc


def warm_server() -> WarmTrain:
    """This pytest process's warm-start server (tests/warm_train.py), started by its first run."""
    if not WARM:
        WARM.append(WarmTrain())
    return WARM[0]


def run_here(
    cwd: Path, *overrides: str, expect: int = 0, timeout: int = 600, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`python <project>/train.py ...` from another folder, without hydra.run.dir: the run folder as a user gets it
    (outputs/<date>/<time>_... under `cwd`); asserts the exit code. `env`: variables set on top of the environment."""
    cmd = [sys.executable, str(PROJECT / "train.py"), *overrides]
    env = {**os.environ, **(env or {})}
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == expect, (
        f"exit {proc.returncode} != {expect} for {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc


def torchrun_cmd(
    run_dir: Path, *overrides: str, launcher_args: tuple[str, ...] = (), nproc: int = 2, script: str = "train.py"
) -> list[str]:
    """`torchrun --standalone --nproc_per_node=<nproc> [launcher_args] <script> ...`, its outputs in `run_dir`."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    launcher += launcher_args
    return [*launcher, script, *overrides, f"hydra.run.dir={run_dir}"]


def run_torchrun(
    run_dir: Path, *overrides: str, expect: int = 0, timeout: int = 300, nproc: int = 2, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`nproc` ranks (two unless told) of train.py under torchrun, to the end; asserts the exit code. `env`: variables
    set for this run on top of the environment."""
    proc = subprocess.run(
        torchrun_cmd(run_dir, *overrides, nproc=nproc),
        cwd=PROJECT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == expect, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def recorded_steps(record: Path, first_step: int = 0) -> dict[int, list[list[int]]]:
    """Global step -> each rank's sample indices, as tests.datasets.RecordingClassification wrote them for one
    command (`record` its RECORD_SAMPLES) that began at `first_step` (the checkpoint's step; 0 when fresh). Of each
    process only its last one counts (`run_batches`); a rank's n-th batch is step first_step + n + 1."""
    steps: dict[int, list[list[int]]] = {}
    for path in sorted(record.parent.glob(f"{record.name}-rank*.jsonl"), key=lambda p: int(p.stem.rsplit("rank")[1])):
        lines = read_jsonl(path)
        mine = [batch for pid in dict.fromkeys(line["pid"] for line in lines) for batch in run_batches(lines, pid)]
        for n, indices in enumerate(mine):
            steps.setdefault(first_step + n + 1, []).append(indices)
    return steps


def run_batches(lines: list[dict], pid: int) -> list[list[int]]:
    """The training batches process `pid` recorded: the lines of the task that trained last (loader=auto's trials
    step a task of their own first), less the throwaway steps before the first batch (the checks' dry step; under
    DDP the step that settles its buckets), which take the data set's first two samples."""
    mine = [line for line in lines if line["pid"] == pid]
    batches = [line["indices"] for line in mine if line["task"] == mine[-1]["task"]]
    throwaway = batches[0]
    while batches and batches[0] == throwaway:
        batches.pop(0)
    return batches


def step_sets(steps: dict[int, list[list[int]]]) -> dict[int, list[int]]:
    """Global step -> its samples, sorted: the union of the ranks' batches."""
    return {step: sorted(i for batch in batches for i in batch) for step, batches in steps.items()}


def last_logged_step(run_dir: Path) -> int:
    """The `step` of the newest complete line of steps.jsonl (0 before the first): one line per log interval."""
    path = run_dir / "steps.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.exists() else []  # the last piece may be half written
    return json.loads(lines[-1])["step"] if lines else 0


def wait_for_steps(run_dir: Path, count: int, timeout: float = 120) -> None:
    """Block until a running train.py has logged step `count` or later (steps.jsonl); fail after `timeout` seconds.

    train.py logs every `log_every_steps` steps: pass `log_every_steps=1` where the test needs a precise point."""
    deadline = time.time() + timeout
    while last_logged_step(run_dir) < count:
        logged = (run_dir / "steps.jsonl").exists()
        seen = f"last logged step {last_logged_step(run_dir)}" if logged else "no steps.jsonl"
        assert time.time() < deadline, f"train.py in {run_dir} did not log step {count} within {timeout:g} s ({seen})"
        time.sleep(0.01)


def load_ckpt(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def same_weights(a: Path, b: Path) -> bool:
    """True when the two checkpoints hold bit-identical model weights under the same names."""
    a, b = load_ckpt(a)["model"], load_ckpt(b)["model"]
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def loader_settings(
    batch_size: int = 16, workers: int = 2, persistent: bool = True, prefetch: int = 2, pin: bool = False
) -> LoaderSettings:
    """LoaderSettings as resolve_settings() would give them for `workers` (no prefetch nor persistence at 0)."""
    settings = LoaderSettings(batch_size, workers, prefetch, pin, persistent, 0.0)
    return settings if workers else settings.in_main()


def end_workers(loader) -> None:
    """End now the DataLoader workers a train loader's failed iteration left (an EpochLoader of engine/loader.py, still
    referenced by the test). Such a loader lives in reference cycles, freed by the garbage collector at some later
    point, where a worker whose loop raised can wait out DataLoader's join timeout (5 s a worker) in whatever test runs
    then. The workers are this process's forked children (the same command line), killed and waited for through
    psutil; DataLoader's shutdown at collection then finds them gone. Torch's SIGCHLD handler, which reports a worker
    of a live iterator that died, raises its RuntimeError while they are killed and waited for here, where it is
    expected, at any point in between (one raised between two kills out of this function in CI): both are tried again
    until every worker is gone."""
    me = psutil.Process()
    workers = [child for child in me.children() if child.cmdline() == me.cmdline()]
    deadline = time.monotonic() + 30
    while True:  # every point where Python runs a signal handler is inside the try, the inner loop's jumps included
        try:
            for worker in workers:
                with contextlib.suppress(psutil.NoSuchProcess):  # reaped by an earlier round
                    worker.kill()
            while workers and time.monotonic() < deadline:
                _, workers = psutil.wait_procs(workers, timeout=1)
            break
        except RuntimeError:  # torch's SIGCHLD handler: a worker died under its live iterator, as intended here
            continue
    assert loader is not None and not workers, f"DataLoader workers still alive: {[w.pid for w in workers]}"


def kill_mid_write(script: str, folder: Path, fifo, size: int) -> bytes:
    """Run `script` (python -c, `folder` its argument), which prints "saved" and then writes into the FIFO it planted
    at `fifo` (a path, or a function of the script's pid giving it); read `size` bytes of that write, then kill -9
    the script while it is still writing. Returns the bytes read."""
    proc = subprocess.Popen([sys.executable, "-c", script, str(folder)], cwd=PROJECT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "saved"
        fifo = fifo(proc.pid) if callable(fifo) else fifo
        assert stat.S_ISFIFO(fifo.stat().st_mode)
        with open(fifo, "rb") as reader:  # the script's open() waits for this reader
            head = reader.read(size)
            time.sleep(0.2)
            assert proc.poll() is None, "the save finished: the kill would not land mid-write"
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        assert proc.returncode == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    return head


def printed_resume(output: str) -> list[str]:
    """The overrides a run's closing line names to go on from its checkpoint (`resume=<path>`, and any override
    printed beside it), to add to the command as printed."""
    ends = ("; to continue: the same command with ", "; to train longer: ")
    (line,) = [x for x in output.splitlines() if any(end in x for end in ends)]
    printed = line.split(ends[0])[-1].split(ends[1])[-1]
    return shlex.split(printed.split(" with more epochs=")[0].split(" and a max_steps above ")[0])
