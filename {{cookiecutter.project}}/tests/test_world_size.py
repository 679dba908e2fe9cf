"""Resuming on another number of processes (engine/resume.py, EpochBatchSampler's global batches): every global step
uses the samples it uses in the run that never stopped, each sample once per epoch, the same weights up to the order
of float sums; always with the run's own command."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from {{ cookiecutter.package }}.engine.loader import EpochBatchSampler, TrainLoader
from tests.datasets import IndexedSamples
from tests.helpers import (
    PROJECT,
    load_ckpt,
    loader_settings,
    read_jsonl,
    recorded_steps,
    run_batches,
    run_torchrun,
    run_train,
    step_sets,
    wait_for_steps,
)
from tests.test_distributed import free_port

# 90 samples with their indices, each drawing noise from torch, numpy and python `random` (rng_mode=per_sample keys
# the draws on (seed, epoch, sample index)), a linear model (no batch statistics), one DataLoader worker per process.
# A global batch of 12: 7 steps per epoch (84 samples; the 6 left over, other ones each epoch, are dropped), 14 in all.
SAMPLES, GLOBAL, STEPS_PER_EPOCH, EPOCHS = 90, 12, 7, 2
INDEXED = [
    "data.train._target_=tests.datasets.IndexedSamples",
    "data.val._target_=tests.datasets.IndexedSamples",
    *[f"~data.{split}.{key}" for split in ("train", "val") for key in ("root", "split", "per_class", "transform")],
{% if cookiecutter.with_photos == "yes" %}
    "~data.train.decode",
    "~data.val.decode",
{% endif %}
    "~data.train.image_size",
    "~data.val.image_size",
    f"+data.train.size={SAMPLES}",
    "+data.val.size=16",
    "data.num_classes=4",
    "model._target_=tests.datasets.Linear",
    "~model.width",
    "+model.in_features=48",
    "task._target_=tests.datasets.RecordingClassification",
    "optim.lr=0.5",  # large steps: every batch moves the weights visibly
    f"epochs={EPOCHS}",
    "log_every_steps=1",
    "checkpoint.keep=0",
    "loader.num_workers=1",
    "progress=false",
]


def command(*extra: str) -> list[str]:
    """The run's own command: loader.batch_size is the per-process batch of the 2 processes it started on."""
    return [*INDEXED, f"loader.batch_size={GLOBAL // 2}", *extra]


def launch(run_dir, world_size: int, record, *overrides: str, expect: int = 0):
    """`python train.py` on one process, torchrun otherwise; one intra-op thread each, as torchrun gives its ranks."""
    record.parent.mkdir(parents=True, exist_ok=True)  # the record is written from the dry step on, before Hydra's
    env = {"RECORD_SAMPLES": str(record), "OMP_NUM_THREADS": "1"}
    if world_size == 1:
        return run_train(run_dir, *overrides, env=env, expect=expect)
    return run_torchrun(run_dir, *overrides, nproc=world_size, env=env, expect=expect, timeout=600)


def straight_run(run_dir, overrides: list[str], world_size: int = 2):
    """The run that never stopped: its samples per step and its last weights."""
    launch(run_dir, world_size, run_dir / "record", *overrides)
    return step_sets(recorded_steps(run_dir / "record")), load_ckpt(run_dir / "checkpoints/last.pth")["model"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    return straight_run(tmp_path_factory.mktemp("straight"), command())


def resumed(run_dir, overrides: list[str], world_sizes: list[int], stops: list[int], global_batch: int = GLOBAL):
    """The run on `world_sizes[0]` processes, stopped at `stops[0]`, requeued (the same command into the same folder,
    resume=latest finding the folder's own last.pth) on the next number of processes and stopped at the next stop...,
    the last one to the end. Returns its samples per step and its last weights."""
    steps, start = {}, 0
    for n, (world_size, stop) in enumerate(zip(world_sizes, [*stops, None], strict=True)):
        record = run_dir / f"record{n}"
        limit = [f"max_steps={stop}"] if stop else []
        launch(run_dir, world_size, record, *overrides, "resume=latest", f"checkpoint.search_dir={run_dir}", *limit)
        segment = recorded_steps(record, start)
        assert all(len(batches) == world_size for batches in segment.values())  # every rank took every step
        assert {len(b) for batches in segment.values() for b in batches} == {global_batch // world_size}
        steps.update(segment)
        start = stop
    log = (run_dir / "train.log").read_text()
    for before, after in zip(world_sizes, world_sizes[1:]):
        if before != after:
            assert f"resuming a {before}-process run on {after} process" in log
    return step_sets(steps), load_ckpt(run_dir / "checkpoints/last.pth")["model"]


def assert_same_run(sets, weights, straight_sets, straight_weights, per_epoch=STEPS_PER_EPOCH, global_batch=GLOBAL):
    assert sorted(sets) == list(range(1, per_epoch * EPOCHS + 1))  # every step once, none replayed
    assert sets == straight_sets  # each global step the same samples as the run that never stopped
    for epoch in range(EPOCHS):  # each sample at most once per epoch (84 of the 90 here)
        seen = [i for s in range(epoch * per_epoch + 1, (epoch + 1) * per_epoch + 1) for i in sets[s]]
        assert len(seen) == len(set(seen)) == per_epoch * global_batch
    for name, tensor in weights.items():
        assert torch.allclose(tensor, straight_weights[name], rtol=1e-4, atol=1e-6), name


@pytest.mark.slow
def test_two_then_three_then_one_process_continue_the_same_global_batches(tmp_path, straight):
    """Stopped mid-epoch 0 on 2 processes, mid-epoch 1 on 3 (across the epoch boundary), ended on 1."""
    sets, weights = resumed(tmp_path, command(), [2, 3, 1], [4, 10])
    assert_same_run(sets, weights, *straight)


@pytest.mark.slow
def test_one_then_two_processes_continue_the_same_global_batches(tmp_path, straight):
    """A run started on 1 process with the global batch as its batch, stopped mid-epoch, ended on 2 with another
    loader profile (no workers, then 2 per process)."""
    steps = {}
    record = tmp_path / "record0"
    launch(tmp_path, 1, record, *INDEXED, f"loader.batch_size={GLOBAL}", "loader.num_workers=0", "max_steps=5")
    steps.update(recorded_steps(record))
    again = ["resume=latest", f"checkpoint.search_dir={tmp_path}", "loader=throughput", "loader.num_workers=2"]
    launch(tmp_path, 2, tmp_path / "record1", *INDEXED, f"loader.batch_size={GLOBAL}", *again)
    two = recorded_steps(tmp_path / "record1", 5)
    assert {len(b) for batches in two.values() for b in batches} == {GLOBAL // 2}
    steps.update(two)
    assert (
        "resuming a 1-process run on 2 processes: global batch 12, 6 per process"
        in (tmp_path / "train.log").read_text()
    )
    assert_same_run(step_sets(steps), load_ckpt(tmp_path / "checkpoints/last.pth")["model"], *straight)


@pytest.mark.slow
def test_negative_control_another_seed_is_far_off(tmp_path, straight):
    """What the comparisons above can tell apart: the same run with another seed has other batches and weights."""
    launch(tmp_path, 1, tmp_path / "record", *INDEXED, f"loader.batch_size={GLOBAL}", "seed=1")
    sets = step_sets(recorded_steps(tmp_path / "record"))
    weights = load_ckpt(tmp_path / "checkpoints/last.pth")["model"]
    straight_sets, straight_weights = straight
    assert sum(sets[s] != straight_sets[s] for s in sets) == len(sets)
    far = max(
        ((weights[k] - straight_weights[k]).abs().max() / straight_weights[k].abs().max()).item() for k in weights
    )
    assert far > 100 * 1e-4, far


@pytest.mark.slow
def test_a_count_that_does_not_split_the_global_batch_is_refused(tmp_path):
    """5 processes cannot share 12 samples a step: one line naming the counts that can, before any work."""
    launch(tmp_path, 1, tmp_path / "record", *command(), "max_steps=1")  # a checkpoint of global batch 6 on 1
    proc = subprocess.run(
        [sys.executable, "train.py", *command("resume=latest", f"checkpoint.search_dir={tmp_path}")]
        + [f"hydra.run.dir={tmp_path}"],
        cwd=PROJECT,
        capture_output=True,
        text=True,
        env={**os.environ, "WORLD_SIZE": "5", "RANK": "0"},
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line == (
        "error: resume: its global batch of 6 samples does not split over 5 processes: resume on 1, 2, 3 or 6 "
        "processes (each then takes global batch / processes)"
    )
    assert [r["step"] for r in read_jsonl(tmp_path / "steps.jsonl")] == [1]  # nothing of the run was touched


def agent(run_dir, port: int, node: int) -> subprocess.Popen:
    """One node's torchrun agent in elastic mode (docs/distributed.md's command): 1 to 2 nodes of 1 process, restarts
    on failure; every attempt resumes from the run folder's own last.pth. Its output goes to node<node>.log."""
    launcher = ["--nnodes=1:2", "--nproc_per_node=1", "--max-restarts=3", "--rdzv-backend=c10d"]
    launcher += [f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic-test"]
    # Once the minimum of nodes has joined, a rendezvous waits last_call_timeout (30 s) for more: the re-formed group
    # of one would sit idle that long. 10 s still leaves the second agent, started 2 s after the first, time to join.
    launcher += ["--rdzv-conf=last_call_timeout=10"]
    run = command("resume=latest", f"checkpoint.search_dir={run_dir}", "checkpoint.every_steps=2")
    run += ["+data.train.item_s=0.01", f"hydra.run.dir={run_dir}"]  # ~60 ms a step: time to kill a node mid-run
    out = open(run_dir / f"node{node}.log", "w")
    env = {**os.environ, "RECORD_SAMPLES": str(run_dir / "record"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher, "train.py", *run]
    return subprocess.Popen(cmd, cwd=PROJECT, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def lose_node(agent: subprocess.Popen) -> None:
    """SIGKILL to every process group of the node: its agent's, and its workers' (torchrun starts each worker in a
    session of its own, so killing the agent's group alone would leave the training process running)."""
    tree = [psutil.Process(agent.pid), *psutil.Process(agent.pid).children(recursive=True)]
    for group in {os.getpgid(p.pid) for p in tree if p.is_running()}:
        os.killpg(group, signal.SIGKILL)


@pytest.mark.slow
def test_node_loss_the_survivor_goes_on_with_the_same_global_batches(tmp_path, straight):
    """torchrun's elastic mode with two agents on this machine as two nodes; one node is lost (SIGKILL) mid-epoch 1.
    The survivor's agent re-forms the group as one node, which resumes from the last checkpoint on 1 process with the
    global batch: every step's samples and the final weights are those of the 2-process run that never stopped."""
    run_dir, port = tmp_path / "job", free_port()
    run_dir.mkdir()
    first = agent(run_dir, port, 0)  # the first to start hosts the rendezvous store: the node that survives
    time.sleep(2)
    second = agent(run_dir, port, 1)
    try:
        wait_for_steps(run_dir, 9, timeout=240)
        lost = [second.pid, *(p.pid for p in psutil.Process(second.pid).children(recursive=True))]
        assert len(lost) >= 3  # the agent, its training process and that one's DataLoader worker
        lose_node(second)
        first.wait(timeout=300)
        log = (run_dir / "node0.log").read_text()
        assert first.returncode == 0, log[-4000:]
    finally:
        for proc in (first, second):
            if proc.poll() is None:
                lose_node(proc)
    assert not [pid for pid in lost if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    train_log = (run_dir / "train.log").read_text()
    assert "resuming a 2-process run on 1 processes" in train_log, train_log[-3000:]
    resumed_at = int(train_log.rsplit("resumed from step ", 1)[1].split()[0])
    assert 2 <= resumed_at <= 12 and resumed_at % 2 == 0  # a checkpoint every 2 steps, the last before the loss
    assert [r["step"] for r in read_jsonl(run_dir / "steps.jsonl")] == list(range(1, 15))
    # the survivor's own record: its last process is the one that resumed; its steps from the checkpoint on
    lines = read_jsonl(run_dir / "record-rank0.jsonl")
    after = run_batches(lines, lines[-1]["pid"])
    straight_sets, straight_weights = straight
    assert {resumed_at + n + 1: sorted(b) for n, b in enumerate(after)} == {
        s: straight_sets[s] for s in range(resumed_at + 1, 15)
    }
    weights = load_ckpt(run_dir / "checkpoints/last.pth")["model"]
    for name, tensor in weights.items():
        assert torch.allclose(tensor, straight_weights[name], rtol=1e-4, atol=1e-6), name


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("size", [90, 95])
def test_global_batches_do_not_depend_on_the_number_of_processes(world_size, size):
    """The sampler alone: global batch i is the same set for any number of processes; the ranks' shares are disjoint."""

    def global_batches(world):
        ranks = [EpochBatchSampler(size, GLOBAL // world, seed=3, rank=r, world_size=world) for r in range(world)]
        for sampler in ranks:
            sampler.set_epoch(1)
        return [sorted(i for share in shares for i in share) for shares in zip(*ranks, strict=True)]

    one = global_batches(1)
    assert len(one) == size // GLOBAL and global_batches(world_size) == one
    flat = [i for batch in one for i in batch]
    assert len(flat) == len(set(flat))


def test_a_loader_state_goes_on_over_another_number_of_processes():
    """TrainLoader alone: 2 ranks stop after 3 batches of epoch 0; 3 ranks loaded from rank 0's state (reseeded, as
    run_state.load_ranks does) serve the rest of the epoch and the next as 1 process with the global batch does."""
    data = IndexedSamples(SAMPLES, draws=False)

    def loaders(world):
        settings = loader_settings(batch_size=GLOBAL // world, workers=0)
        return [TrainLoader(data, settings, seed=4, rank=r, world_size=world) for r in range(world)]

    def global_steps(ranks, epochs=1):
        out = []
        for _ in range(epochs):
            for shares in zip(*ranks, strict=True):
                out.append(sorted(int(i) for _, _, index in shares for i in index))
        return out

    one = global_steps(loaders(1), epochs=2)
    two = loaders(2)
    first = [iter(loader) for loader in two]
    for _ in range(3):
        for it in first:
            next(it)
    state = two[0].state_dict()
    assert state["position"] == 3 and state["global_batch"] == GLOBAL
    three = loaders(3)
    for rank, loader in enumerate(three):
        loader.load_state_dict(state, reseed=100 + rank)
    assert global_steps(three, epochs=2) == one[3:]
