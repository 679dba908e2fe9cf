"""Streams through train.py: each record once per epoch over workers and processes, and a mid-epoch resume that
is the run that never stopped (tests.datasets.CountingShards: 8 unequal shards; SplitStream, StatefulStream)."""

import pytest
import torch

from {{ cookiecutter.package }}.engine import shard_plan
from {{ cookiecutter.package }}.engine.shard_plan import RESTART_EPOCH
from {{ cookiecutter.package }}.engine.stream_loader import StreamLoader
from tests.datasets import CountingShards
from tests.helpers import (
    load_ckpt,
    loader_settings,
    printed_resume,
    read_jsonl,
    recorded_steps,
    run_torchrun,
    run_train,
    same_weights,
)
from tests.test_stream import write_jsonl

SIZES = (37, 5, 60, 18, 41, 9, 26, 14)
ALL = sorted(s * 1000 + i for s, n in enumerate(SIZES) for i in range(n))
STREAM = [
    "data.train._target_=tests.datasets.CountingShards",
    "data.val._target_=tests.datasets.CountingShards",
    *[f"~data.{split}.{key}" for split in ("train", "val") for key in ("root", "split", "per_class", "transform")],
    *[f"~data.{split}.{key}" for split in ("train", "val") for key in [{% if cookiecutter.with_photos == "yes" %}"decode", {% endif %}"image_size"]],
    "+data.val.sizes=[6,5,4]",
    "data.num_classes=4",
    "model._target_=tests.datasets.Linear",
    "~model.width",
    "+model.in_features=48",
    "task._target_=tests.datasets.RecordingClassification",
    "optim.lr=0.5",  # large steps: every batch moves the weights visibly
    "epochs=2",
    "log_every_steps=1",
    "checkpoint.keep=0",
    "loader.num_workers=2",
    "loader.batch_size=8",
    "progress=false",
]


def per_epoch(workers: int = 2, world: int = 1, seed: int = 0) -> list[int]:
    """Each epoch's steps as the run plans them (two epochs)."""
    loader = StreamLoader(CountingShards(SIZES), loader_settings(batch_size=8, workers=workers), seed=seed)
    out = []
    for _ in range(2):
        out.append(loader.batches_per_epoch)
        for _ in loader:
            pass
    return out


def epochs_of(steps: dict[int, list[list[int]]], lengths: list[int]) -> list[list[int]]:
    keys, at = [], 1
    for length in lengths:
        keys.append(sorted(k for s in range(at, at + length) for batch in steps.get(s, []) for k in batch))
        at += length
    return keys


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("straight")
    record = run_dir / "samples"
    run_train(run_dir, *STREAM, env={"RECORD_SAMPLES": str(record)})
    return run_dir, recorded_steps(record)


def test_each_record_once_per_epoch_with_two_workers(straight):
    run_dir, steps = straight
    lengths = per_epoch()
    assert sum(lengths) == len(steps) == load_ckpt(run_dir / "checkpoints/last.pth")["step"]
    assert epochs_of(steps, lengths) == [ALL, ALL]
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["dropped_records"] for r in metrics] == [0, 0]
    assert len(metrics[0]["worker_pids"]) == 2 and metrics[0]["worker_pids"] == metrics[1]["worker_pids"]  # kept


UNSIZED = ("+data.train.with_sizes=false", "schedule.total_steps=60")  # the epoch's end shows as the stream ends


@pytest.mark.parametrize(
    "extra",
    [
        # 4 runs of train.py: the slow tier's; the fast tier resumes a stream batch for batch through StreamLoader
        # (test_stream_loader.py, the same negative control) and resumes train.py exactly in test_resume.py
        pytest.param((), marks=pytest.mark.slow),
        # a window may close at an epoch's unknown end
        pytest.param((*UNSIZED, "accumulate_steps=2", "val_every_steps=3"), marks=pytest.mark.slow),
        pytest.param(("loader=memory-tight", "loader.num_workers=3"), marks=pytest.mark.slow),  # workers end each epoch
        # the main process reads: its own RNG left as the data found it
        pytest.param(("loader.num_workers=0",), marks=pytest.mark.slow),
        pytest.param(("loader.num_workers=auto",), marks=pytest.mark.slow),  # as many workers as CPUs, at resume too
    ],
    ids=["sizes", "no-sizes-accumulate-validate", "not-persistent-3-workers", "no-workers", "workers-auto"],
)
def test_a_mid_epoch_stop_resumes_torch_equal(tmp_path, straight, extra):
    if extra:
        reference = tmp_path / "straight"
        run_train(reference, *STREAM, *extra)
    else:
        reference, _ = straight
    first, second = tmp_path / "first", tmp_path / "second"
    run_train(first, *STREAM, *extra, "max_steps=11")
    run_train(second, *STREAM, *extra, f"resume={first}/checkpoints/last.pth")
    assert same_weights(reference / "checkpoints/last.pth", second / "checkpoints/last.pth")
    losses = [r["loss"] for r in read_jsonl(first / "steps.jsonl") + read_jsonl(second / "steps.jsonl")]
    assert losses == [r["loss"] for r in read_jsonl(reference / "steps.jsonl")]
    if extra:
        return
    # negative control: the same resume without the consumed counts re-reads the epoch from its first records
    ckpt = load_ckpt(first / "checkpoints/last.pth")
    ckpt["ranks"][0]["loader"]["consumed"].zero_()
    torch.save(ckpt, tmp_path / "zeroed.pth")
    run_train(tmp_path / "control", *STREAM, f"resume={tmp_path / 'zeroed.pth'}")
    assert not same_weights(reference / "checkpoints/last.pth", tmp_path / "control/checkpoints/last.pth")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_workers_that_get_the_stream_pickled_resume_it_exactly(tmp_path, straight, method):
    """Started by spawn or forkserver, workers receive the stream pickled: the epoch and the consumed records still
    reach them through shared memory."""
    reference, _ = straight
    first, second = tmp_path / "first", tmp_path / "second"
    run_train(first, *STREAM, "max_steps=11", start_method=method)
    run_train(second, *STREAM, f"resume={first}/checkpoints/last.pth", start_method=method)
    assert same_weights(reference / "checkpoints/last.pth", second / "checkpoints/last.pth")


@pytest.mark.slow
def test_resumed_on_three_workers_the_epoch_still_reads_each_record_once(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    env = {"RECORD_SAMPLES": str(tmp_path / "samples")}
    run_train(first, *STREAM, "max_steps=9", "epochs=1", env=env)
    head = recorded_steps(tmp_path / "samples")
    env = {"RECORD_SAMPLES": str(tmp_path / "rest")}
    resume = f"resume={first}/checkpoints/last.pth"
    proc = run_train(second, *STREAM, "epochs=1", "loader.num_workers=3", resume, env=env)
    assert "order of its batches changed" in proc.stdout + proc.stderr
    keys = [k for steps in (head, recorded_steps(tmp_path / "rest")) for b in steps.values() for k in b[0]]
    assert sorted(keys) == ALL


PLAIN = [o for o in STREAM if not o.startswith(("data.train._target_", "+data.val"))]


@pytest.mark.slow
def test_a_stateful_plain_stream_resumes_exactly_and_a_stateless_one_is_refused(tmp_path):
    stateful = [*PLAIN, "data.train._target_=tests.datasets.StatefulStream", "schedule=constant"]
    run_train(tmp_path / "straight", *stateful)
    run_train(tmp_path / "first", *stateful, "max_steps=7")
    run_train(tmp_path / "second", *stateful, f"resume={tmp_path}/first/checkpoints/last.pth")
    assert same_weights(tmp_path / "straight/checkpoints/last.pth", tmp_path / "second/checkpoints/last.pth")
    stateless = [*PLAIN, "data.train._target_=tests.datasets.SplitStream", "schedule=constant"]
    run_train(tmp_path / "plain", *stateless, "max_steps=7")
    proc = run_train(tmp_path / "refused", *stateless, f"resume={tmp_path}/plain/checkpoints/last.pth", expect=2)
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: resume:")
    assert "data.stream_resume=restart_epoch" in proc.stderr
    assert not (tmp_path / "refused/checkpoints").exists()
    # the control: the stateful run's resume with its saved states dropped is not the straight run
    ckpt = load_ckpt(tmp_path / "first/checkpoints/last.pth")
    ckpt["ranks"][0]["loader"]["states"] = {}
    torch.save(ckpt, tmp_path / "stateless.pth")
    run_train(tmp_path / "control", *stateful, f"resume={tmp_path / 'stateless.pth'}")
    assert not same_weights(tmp_path / "straight/checkpoints/last.pth", tmp_path / "control/checkpoints/last.pth")


@pytest.mark.slow
def test_restart_epoch_starts_a_stateless_stream_over(tmp_path):
    stateless = [*PLAIN, "data.train._target_=tests.datasets.SplitStream", "schedule=constant", "epochs=1"]
    run_train(tmp_path / "plain", *stateless, "max_steps=7")
    resume = f"resume={tmp_path}/plain/checkpoints/last.pth"
    proc = run_train(tmp_path / "again", *stateless, RESTART_EPOCH, resume)
    assert "starts over" in proc.stdout + proc.stderr
    assert "data.stream_resume exact -> restart_epoch" not in proc.stdout + proc.stderr  # not a change "the same"
    assert read_jsonl(tmp_path / "again/metrics.jsonl")[-1]["epoch"] == 0


def test_a_stream_without_sizes_needs_a_schedule_of_its_own_length(tmp_path):
    proc = run_train(tmp_path / "refused", *STREAM, UNSIZED[0], expect=2)
    assert proc.stderr.startswith("error: schedule") and "schedule.total_steps" in proc.stderr


@pytest.mark.slow
def test_a_stream_without_sizes_trains_on_a_schedule_of_its_own_length(tmp_path):
    """What the line above asks for: with schedule.total_steps, each record once an epoch, the epoch's end seen as
    the stream ends."""
    unsized = [*STREAM, UNSIZED[0], "schedule.warmup_steps=0"]
    env = {"RECORD_SAMPLES": str(tmp_path / "samples")}
    proc = run_train(tmp_path / "ok", *unsized, "schedule.total_steps=60", env=env)
    steps = recorded_steps(tmp_path / "samples")
    assert sorted(k for b in steps.values() for k in b[0]) == sorted(ALL + ALL)
    assert [r["epoch"] for r in read_jsonl(tmp_path / "ok/metrics.jsonl")] == [0, 1]
    # docs/resume.md's way to train longer: the printed resume= with 2 more epochs on a schedule as long again
    # (total_steps doubled), so the LR still falls at its end; the control keeps total_steps=60, its floor from step 60
    more = [*unsized, *printed_resume(proc.stdout + proc.stderr), "epochs=4", "resume_strict=false"]
    for name, total in (("longer", 120), ("control", 60)):
        run_train(tmp_path / name, *more, f"schedule.total_steps={total}")
    last = [r["lr"] for r in read_jsonl(tmp_path / "longer/steps.jsonl")][-10:]
    assert all(a > b for a, b in zip(last, last[1:]))
    assert len({r["lr"] for r in read_jsonl(tmp_path / "control/steps.jsonl")[-10:]}) == 1


@pytest.mark.slow
def test_a_bad_record_is_named_by_shard_and_index_or_skipped(tmp_path):
    bad = [*STREAM, "+data.train.bad=[2017]", "epochs=1"]
    proc = run_train(tmp_path / "error", *bad, expect=3)
    assert "shard 2 (2) record 17: ValueError: record 2017 is corrupt" in proc.stderr
    assert proc.stderr.count("\n") == 1
    env = {"RECORD_SAMPLES": str(tmp_path / "samples")}
    run_train(tmp_path / "skip", *bad, "data.on_bad_sample=skip", env=env)
    keys = [k for b in recorded_steps(tmp_path / "samples").values() for k in b[0]]
    assert sorted(keys) == [k for k in ALL if k != 2017]
    assert "record 17" in (tmp_path / "skip/bad_samples.txt").read_text()
    assert read_jsonl(tmp_path / "skip/metrics.jsonl")[-1]["bad_samples"] == 1
    refused = run_train(tmp_path / "refused", *bad, "data.train._target_=tests.datasets.ReadOnlyShards",
                        "data.on_bad_sample=skip", expect=2)  # fmt: skip
    assert "read(shard, start=0)" in refused.stderr


@pytest.mark.slow
def test_a_stalled_reader_is_named_and_the_run_saved(tmp_path):
    proc = run_train(tmp_path, *STREAM, "+data.train.item_s=5", "loader.timeout=1", expect=75)
    assert proc.stderr.startswith("error: loader.timeout: no batch for 1 s: batch 0 of epoch 0 is made by DataLoader")
    assert (tmp_path / "stall_stacks.txt").exists()


@pytest.mark.slow  # a run; the fast tier reads json lines files in test_stream.py and trains a stream in the first test
def test_json_lines_files_train_through_train_py(tmp_path):
    write_jsonl(tmp_path / "data/train", [30, 12, 21], dim=6)
    write_jsonl(tmp_path / "data/val", [8], dim=6)
    kept = ("model.", "~model.", "optim.", "epochs=", "log_every_steps=", "loader.", "progress=")
    jsonl = [o for o in STREAM if o.startswith(kept)]
    run_train(tmp_path / "run", *jsonl, "data=jsonlines", f"data.root={tmp_path / 'data'}", "data.num_classes=2",
              "+model.in_features=6")  # fmt: skip
    assert [r["epoch"] for r in read_jsonl(tmp_path / "run/metrics.jsonl")] == [0, 1]


@pytest.mark.slow
def test_two_torchrun_processes_step_together_and_no_record_repeats(tmp_path):
    record = tmp_path / "samples"
    run_torchrun(tmp_path / "run", *STREAM, "loader.batch_size=4", env={"RECORD_SAMPLES": str(record)})
    steps = recorded_steps(record)
    assert all(len(batches) == 2 for batches in steps.values())  # both ranks took every step
    metrics = read_jsonl(tmp_path / "run/metrics.jsonl")
    first = 1
    for epoch in range(2):  # each epoch's steps as the plan gives them: 2 ranks x 2 workers, 4 records a batch
        plan = shard_plan.reader_shards(0, epoch, list(SIZES), len(SIZES), 4)
        length = shard_plan.steps_left(plan, list(SIZES), [0] * len(SIZES), 4, 2)
        keys = [k for s in range(first, first + length) for batch in steps[s] for k in batch]
        assert len(keys) == len(set(keys))  # no record twice
        assert metrics[epoch]["dropped_records"] > 0
        assert len(keys) + metrics[epoch]["dropped_records"] == len(ALL)  # the rest dropped, and counted
        first += length
    assert first - 1 == len(steps)


@pytest.mark.slow
def test_a_two_process_stop_resumes_on_one_process_each_remaining_record_once(tmp_path):
    env = {"RECORD_SAMPLES": str(tmp_path / "head")}
    run_torchrun(tmp_path / "two", *STREAM, "loader.batch_size=4", "epochs=1", "max_steps=8", env=env)
    head = [k for batches in recorded_steps(tmp_path / "head").values() for batch in batches for k in batch]
    assert len(head) == 8 * 8
    env = {"RECORD_SAMPLES": str(tmp_path / "rest")}
    resume = f"resume={tmp_path}/two/checkpoints/last.pth"
    proc = run_train(tmp_path / "one", *STREAM, "loader.batch_size=4", "epochs=1", resume, env=env)
    assert "order of its batches changed" in proc.stdout + proc.stderr
    rest = [k for batches in recorded_steps(tmp_path / "rest").values() for batch in batches for k in batch]
    assert sorted(head + rest) == ALL  # one process drops nothing: the epoch's every record, once


@pytest.mark.slow
def test_a_stateless_stream_goes_on_from_an_epochs_end_and_restart_epoch_adds_no_epoch(tmp_path):
    stateless = [*PLAIN, "data.train._target_=tests.datasets.SplitStream", "schedule=constant"]
    run_train(tmp_path / "straight", *stateless)
    straight = read_jsonl(tmp_path / "straight/metrics.jsonl")
    end = straight[0]["step"]  # epoch 0's last step
    run_train(tmp_path / "stopped", *stateless, f"max_steps={end}")
    assert [line["step"] for line in read_jsonl(tmp_path / "stopped/metrics.jsonl")] == [end]  # validated
    for name, extra in (("resumed", []), ("restarted", [RESTART_EPOCH])):
        run_train(tmp_path / name, *stateless, *extra, f"resume={tmp_path}/stopped/checkpoints/last.pth")
        assert same_weights(tmp_path / name / "checkpoints/last.pth", tmp_path / "straight/checkpoints/last.pth")
        assert [line["step"] for line in read_jsonl(tmp_path / name / "metrics.jsonl")] == [straight[1]["step"]]


@pytest.mark.slow
def test_the_commands_a_stopped_stateless_stream_prints_work_as_printed(tmp_path):
    stateless = [*PLAIN, "data.train._target_=tests.datasets.SplitStream", "schedule=constant"]
    stopped = run_train(tmp_path / "stopped", *stateless, "max_steps=7")
    go_on = printed_resume(stopped.stdout + stopped.stderr)  # mid-epoch: the epoch starts over
    assert RESTART_EPOCH in go_on
    proc = run_train(tmp_path / "continued", *stateless, *go_on)  # the same command, max_steps raised (none)
    assert "starts over" in proc.stdout + proc.stderr
    more = printed_resume(proc.stdout + proc.stderr)  # finished: resume= with more epochs (docs/resume.md)
    run_train(tmp_path / "more", *stateless, *more, "epochs=4", "resume_strict=false")
    assert read_jsonl(tmp_path / "more/metrics.jsonl")[-1]["epoch"] == 3
    # the refusal of the plain resume names the addition that makes it work, which then does
    resume = f"resume={tmp_path}/stopped/checkpoints/last.pth"
    refused = run_train(tmp_path / "refused", *stateless, resume, expect=2)
    assert f"add {RESTART_EPOCH} to the command" in refused.stderr
    run_train(tmp_path / "refused", *stateless, resume, RESTART_EPOCH)


@pytest.mark.slow
def test_a_resume_refused_for_another_reader_count_says_nothing_of_a_run_that_stays_the_same(tmp_path):
    stateful = [*PLAIN, "data.train._target_=tests.datasets.StatefulStream", "schedule=constant"]
    run_train(tmp_path / "first", *stateful, "max_steps=7")
    resume = f"resume={tmp_path}/first/checkpoints/last.pth"
    proc = run_train(tmp_path / "refused", *stateful, resume, "loader.num_workers=1", expect=2)
    assert proc.stderr.count("\n") == 1 and "resume with loader.num_workers=2" in proc.stderr
    assert "keep the run the same" not in proc.stdout + proc.stderr
    assert not (tmp_path / "refused").exists()  # refused before the run folder is written
