"""A resumed run writes the record of the run that never stopped (engine/epoch_meter.py's EpochMeter.state in every
mid-epoch checkpoint): metrics.jsonl and steps.jsonl equal but for the fields that measure time, memory or the
processes, after a stop mid-epoch and one at an epoch's end, whose validation runs before the stop."""

import shutil

import pytest
import torch

from tests.helpers import load_ckpt, read_jsonl, run_train, same_weights

# What differs between any two runs, stopped or not: docs/resume.md's "The same record" names them
MEASURED = {
    "samples_per_s", "data_wait_s", "epoch_time_s", "data_wait_share", "rss_mib", "pss_mib", "fds",
    "page_faults_per_batch", "worker_pids",
}  # fmt: skip
RUN = ["experiment=debug", "epochs=3", "log_every_steps=2", "checkpoint.monitor=train_loss", "checkpoint.mode=min"]


def record(run_dir) -> tuple[list[dict], list[dict]]:
    metrics = [{k: v for k, v in line.items() if k not in MEASURED} for line in read_jsonl(run_dir / "metrics.jsonl")]
    return metrics, read_jsonl(run_dir / "steps.jsonl")


# with workers kept across epochs: a mid-epoch resume finishes the epoch on one-off workers, which end with it
WORKERS = ["loader.num_workers=2", "loader.persistent_workers=true", "loader.prefetch_factor=2"]


@pytest.mark.slow
@pytest.mark.parametrize("workers", [[], WORKERS], ids=["no-workers", "2-persistent-workers"])
def test_a_resumed_run_writes_the_straight_runs_record(tmp_path, workers):
    run = [*RUN, *workers]
    run_train(tmp_path / "straight", *run)
    straight = record(tmp_path / "straight")
    assert [line["step"] for line in straight[0]] == [5, 10, 15]
    for stop in (7, 10):  # mid-epoch 1, off the log interval; epoch 1's last step
        run_dir = tmp_path / f"stopped{stop}"
        run_train(run_dir, *run, f"max_steps={stop}")
        assert [line["step"] for line in read_jsonl(run_dir / "metrics.jsonl")] == [5, 10][: stop // 5]
        shutil.copy(run_dir / "checkpoints/last.pth", tmp_path / f"stop{stop}.pth")
        run_train(run_dir, *run, f"resume={run_dir}/checkpoints/last.pth")
        assert record(run_dir) == straight, f"stopped at {stop}"
        assert same_weights(run_dir / "checkpoints/last.pth", tmp_path / "straight/checkpoints/last.pth")
        assert load_ckpt(run_dir / "checkpoints/best.pth")["metrics"]["step"] == straight[0][-1]["step"]
    if workers:
        assert {line["worker_count"] for line in straight[0]} == {2}  # what the straight run counts, and so the resumed
        return
    # the control: the mid-epoch checkpoint without its running sums gives the same weights and another record
    assert load_ckpt(tmp_path / "stop10.pth")["meter"] is None  # an epoch's end carries nothing into the next
    ckpt = load_ckpt(tmp_path / "stop7.pth")
    assert ckpt["meter"]["epoch"]["samples"] == 2 * 32 and ckpt["meter"]["window"]["batches"] == 1
    ckpt["meter"] = None
    torch.save(ckpt, tmp_path / "no-sums.pth")
    run_train(tmp_path / "control", *RUN, f"resume={tmp_path / 'no-sums.pth'}")
    metrics, steps = record(tmp_path / "control")
    assert same_weights(tmp_path / "control/checkpoints/last.pth", tmp_path / "straight/checkpoints/last.pth")
    assert metrics[0] != straight[0][1] and steps[0] != [s for s in straight[1] if s["step"] > 7][0]
