"""What a run writes for people (runlog.py): lines past a resumed checkpoint are dropped, other ranks write nothing."""

import json

from {{ cookiecutter.package }}.engine.runlog import RunLog, drop_records_from
from tests.helpers import read_jsonl


def test_drop_records_from_keeps_only_earlier_steps(tmp_path):
    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 9)))
    drop_records_from(path, 5)
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3, 4]
    drop_records_from(tmp_path / "absent.jsonl", 5)  # nothing to drop: not created
    assert not (tmp_path / "absent.jsonl").exists()


def test_resumed_runlog_continues_after_the_checkpoint(tmp_path):
    crashed = RunLog(tmp_path)
    for step in range(1, 7):
        crashed.step(step, loss=float(step), lr=0.1)
    crashed.epoch({"epoch": 0, "step": 3, "train_loss": 1.0})
    crashed.epoch({"epoch": 1, "step": 6, "train_loss": 0.5})
    crashed.close()
    resumed = RunLog(tmp_path, purge_step=4)  # the checkpoint was at step 3
    resumed.step(4, loss=40.0, lr=0.1)
    resumed.close()
    assert [(r["step"], r["loss"]) for r in read_jsonl(tmp_path / "steps.jsonl")] == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 40.0),
    ]
    assert [r["epoch"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0]
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_disabled_runlog_writes_nothing(tmp_path):
    log = RunLog(tmp_path / "rank1", enabled=False)
    log.step(1, 1.0, 0.1)
    log.epoch({"epoch": 0, "step": 1})
    log.close()
    assert not (tmp_path / "rank1").exists()
