"""What a run writes for people (runlog.py): lines past a resumed checkpoint are dropped, other ranks write nothing."""

{% if cookiecutter.with_tracking == "yes" %}
import csv

{% endif %}
from {{ cookiecutter.package }}.engine.runlog import RunLog
from tests.helpers import read_jsonl


def test_resumed_runlog_continues_after_the_checkpoint(tmp_path):
    crashed = RunLog(tmp_path)
    for step in range(1, 7):
        crashed.step(step, 0.1, {"loss": float(step)})
    crashed.epoch({"epoch": 0, "step": 3, "train_loss": 1.0})
    crashed.epoch({"epoch": 1, "step": 6, "train_loss": 0.5})
    crashed.close()
    resumed = RunLog(tmp_path, purge_step=4)  # the checkpoint was at step 3
    resumed.step(4, 0.1, {"loss": 40.0})
    resumed.close()
    assert [(r["step"], r["loss"]) for r in read_jsonl(tmp_path / "steps.jsonl")] == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 40.0),
    ]
    assert [r["epoch"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0]
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    RunLog(tmp_path / "new", purge_step=4).close()  # a resume into a new folder: nothing to drop
    assert [read_jsonl(tmp_path / "new" / f"{name}.jsonl") for name in ("steps", "metrics")] == [[], []]


{% if cookiecutter.with_tracking == "yes" %}
def test_csv_rows_follow_the_jsonl_lines_over_a_resume(tmp_path):
    crashed = RunLog(tmp_path, use=["csv"])
    for step in range(1, 7):
        crashed.step(step, 0.1, {"loss": float(step), "loss_aux": step / 2})
    crashed.epoch({"epoch": 0, "step": 3, "train_loss": 1.0, "mid_epoch": False, "worker_pids": [1, 2]})
    crashed.epoch({"epoch": 1, "step": 6, "train_loss": 0.5})
    crashed.close()
    resumed = RunLog(tmp_path, purge_step=4, use=["csv"])  # the checkpoint was at step 3
    resumed.step(4, 0.1, {"loss": 40.0, "loss_aux": 2.0})
    resumed.close()
    with open(tmp_path / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["step", "loss", "lr", "grad_norm", "loss_aux"]  # grad_norm's column without clipping
    assert [(r["step"], r["loss"], r["loss_aux"]) for r in rows] == [
        ("1", "1.0", "0.5"), ("2", "2.0", "1.0"), ("3", "3.0", "1.5"), ("4", "40.0", "2.0")]  # fmt: skip
    with open(tmp_path / "metrics.csv") as f:
        assert list(csv.DictReader(f)) == [{"step": "3", "epoch": "0", "train_loss": "1.0"}]  # numbers only
    assert not (tmp_path / "tb").exists()  # tensorboard not in `use`
    control = RunLog(tmp_path / "control")  # csv not in `use`: no table
    control.step(1, 0.1, {"loss": 1.0})
    control.close()
    assert not (tmp_path / "control" / "steps.csv").exists()


{% endif %}
def test_disabled_runlog_writes_nothing(tmp_path):
    log = RunLog(tmp_path / "rank1", enabled=False)
    log.step(1, 0.1, {"loss": 1.0})
    log.epoch({"epoch": 0, "step": 1})
    log.close()
    assert not (tmp_path / "rank1").exists()
