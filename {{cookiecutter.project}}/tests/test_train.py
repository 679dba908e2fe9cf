"""Short real trainings on generated image files: outputs, every profile, worker lifetimes, max_steps."""

import pytest

from tests.helpers import load_ckpt, read_jsonl, run_train

EPOCH_KEYS = {"epoch", "step", "train_loss", "val_loss", "val_acc", "samples_per_s", "data_wait_s", "worker_pids"}


# balanced in the fast tier, the other two profiles in the slow one
PROFILES = [
    pytest.param("memory-tight", marks=pytest.mark.slow),
    "balanced",
    pytest.param("throughput", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("profile", PROFILES)
def test_short_training_per_profile(request, tmp_path, shapes, profile):
    if profile == "balanced":  # the default profile: the session's shared run (conftest.py) is this command
        tmp_path = request.getfixturevalue("shapes_run")
    else:
        run_train(tmp_path, f"loader={profile}", *shapes)
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["epoch"] for r in records] == [0, 1]
    assert all(EPOCH_KEYS <= r.keys() for r in records)
    assert records[-1]["step"] == 2 * (160 // 32)
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    ckpt = load_ckpt(tmp_path / "checkpoints" / "last.pth")
    assert {"model", "optimizer", "epoch", "step"} <= ckpt.keys()
    assert ckpt["epoch"] == 2 and ckpt["step"] == records[-1]["step"]
    pids = [r["worker_pids"] for r in records]
    if profile == "memory-tight":
        assert len(pids[0]) == 1 and not set(pids[0]) & set(pids[1])  # workers restart each epoch
    else:
        assert pids[0] == pids[1] and len(pids[0]) >= 2  # the same workers serve every epoch


@pytest.mark.slow
def test_zero_workers(tmp_path, shapes):
    run_train(tmp_path, "loader.num_workers=0", *shapes)
    assert [r["worker_pids"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [[], []]


@pytest.mark.slow
def test_max_steps_stops_and_saves(tmp_path, shapes):
    run_train(tmp_path, "max_steps=3", *shapes)
    assert load_ckpt(tmp_path / "checkpoints" / "last.pth")["step"] == 3
    # a stop inside a log interval writes no line: its sums travel in the checkpoint, so a resumed run's lines are a
    # straight run's (test_resume.py)
    assert read_jsonl(tmp_path / "steps.jsonl") == []
    assert not (tmp_path / "metrics.jsonl").read_text()  # stopped inside the first epoch


@pytest.mark.slow
def test_resnet18_and_adamw(tmp_path, shapes):
    run_train(tmp_path, "model=resnet18", "optim=adamw", "max_steps=2", *shapes)
    ckpt = load_ckpt(tmp_path / "checkpoints" / "last.pth")
    assert "layer4.1.conv2.weight" in ckpt["model"] and ckpt["model"]["fc.weight"].shape == (4, 512)
    assert all({"exp_avg", "exp_avg_sq"} <= s.keys() for s in ckpt["optimizer"]["state"].values())  # AdamW's moments
    assert ckpt["config"]["optim"]["_target_"] == "torch.optim.AdamW" and ckpt["step"] == 2
