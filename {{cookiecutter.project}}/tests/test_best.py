"""checkpoints/best.pth: the best epoch by checkpoint.monitor/mode, kept across a resume, refused when unknown."""

import shutil

import pytest
import torch

from {{ cookiecutter.package }}.engine.checkpoint import Best, Checkpointer, improves
from tests.helpers import RNG_DATA, load_ckpt, read_jsonl, run_train


@pytest.mark.parametrize("mode, values, kept", [("max", [0.5, 0.7, 0.6, 0.7], 1), ("min", [0.5, 0.7, 0.4, 0.4], 2)])
def test_best_keeps_the_first_best_epoch(tmp_path, mode, values, kept):
    saver, best = Checkpointer(tmp_path, keep=0), Best("val_acc", mode)
    for epoch, value in enumerate(values):
        state = {"step": epoch, "w": torch.full((3,), float(epoch))}
        record = {"epoch": epoch, "val_acc": value}
        saver.save(state, record if best.judge(record) else None)  # as CheckpointPolicy.save does
        assert best.state() == {
            "monitor": "val_acc",
            "mode": mode,
            "value": values[kept] if epoch >= kept else best.value,
        }
    saved = load_ckpt(tmp_path / "best.pth")
    assert saved["metrics"] == {"epoch": kept, "val_acc": values[kept]} and torch.equal(
        saved["w"], torch.full((3,), float(kept))
    )
    assert not list(tmp_path.glob(".tmp-*"))  # written through a temp file and renamed


def test_the_best_value_comes_back_from_a_checkpoint(tmp_path):
    saved = {"monitor": "val_loss", "mode": "min", "value": 0.25}  # a checkpoint's `best` part

    def loaded(monitor: str, mode: str) -> Best:
        best = Best(monitor, mode)
        best.load(saved)
        return best

    assert loaded("val_loss", "min").value == 0.25
    assert loaded("val_acc", "max").value is None  # another rule: the old value means nothing
    assert not loaded("val_loss", "min").judge({"val_loss": 0.3})
    fresh = Best("val_loss", "min")
    assert not fresh.judge({"val_loss": float("nan")}) and fresh.judge({"val_loss": 9.0})  # NaN never the best


@pytest.mark.slow
def test_unknown_monitor_is_refused_by_train_py_in_one_line(tmp_path):
    proc = run_train(tmp_path, "checkpoint.monitor=val_accuracy", expect=2)
    (line,) = proc.stderr.strip().splitlines()
    # the dry step runs the task's metrics before any training: the refusal names what it reports
    assert line == (
        "error: checkpoint.monitor=val_accuracy is not reported by task {{ cookiecutter.package }}.tasks.Classification: "
        "pick one of train_loss, val_loss, val_acc"
    )


SAME = ("epoch", "step", "train_loss", "val_loss", "val_acc")  # timings and process figures differ between runs

# train_loss with mode=max: its best epoch is the first, so later epochs must not replace best.pth
RULE = ["checkpoint.monitor=train_loss", "checkpoint.mode=max", "epochs=2", "checkpoint.keep=0"]


@pytest.mark.slow
def test_a_resumed_run_does_not_overwrite_a_better_best(tmp_path):
    run_train(tmp_path / "straight", *RNG_DATA, *RULE)
    records = read_jsonl(tmp_path / "straight/metrics.jsonl")
    expected = next(r for r in records if r["train_loss"] == max(r["train_loss"] for r in records))
    assert expected["epoch"] == 0, "the data no longer gives an early best epoch: this test checks nothing"
    assert load_ckpt(tmp_path / "straight/checkpoints/best.pth")["metrics"] == expected
    stop = expected["step"] + 3  # inside the epoch after the best one
    run_train(tmp_path / "resumed", *RNG_DATA, *RULE, f"max_steps={stop}")
    shutil.copytree(tmp_path / "resumed", tmp_path / "control")  # the same stopped run, for the control
    for name, keep_best in (("resumed", True), ("control", False)):
        run_dir = tmp_path / name
        if not keep_best:  # negative control: a checkpoint without the best value, as a naive resume would have
            ckpt = load_ckpt(run_dir / "checkpoints/last.pth")
            del ckpt["best"]
            torch.save(ckpt, run_dir / "checkpoints/last.pth")
        run_train(run_dir, *RNG_DATA, *RULE, "resume=latest", f"checkpoint.search_dir={run_dir}")  # the same folder
        got = load_ckpt(run_dir / "checkpoints/best.pth")["metrics"]
        if keep_best:
            assert {k: got[k] for k in SAME} == {k: expected[k] for k in SAME}
        else:
            assert got["epoch"] > expected["epoch"]  # a worse epoch overwrote the best one


def test_one_rule_judges_best_pth_and_early_stopping():
    """`improves`: a NaN beats nothing, anything else beats no best; min_delta is a margin (EarlyStopping's)."""
    assert improves(0.5, None, "max") and not improves(float("nan"), None, "max")
    assert improves(0.6, 0.5, "max") and improves(0.4, 0.5, "min") and not improves(0.5, 0.5, "max")
    assert not improves(0.55, 0.5, "max", min_delta=0.1) and improves(0.65, 0.5, "max", min_delta=0.1)
    assert not improves(float("nan"), 0.5, "min")
