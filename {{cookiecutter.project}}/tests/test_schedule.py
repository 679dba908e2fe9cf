"""The LR schedule (schedule.py): linear warm-up, cosine decay to a floor, and a state that survives a checkpoint."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from {{ cookiecutter.package }}.engine.parts import schedule
from {{ cookiecutter.package }}.engine.schedule import WarmupCosine, warmup_cosine


def test_warmup_rises_linearly_to_the_peak():
    factor = WarmupCosine(warmup_steps=4, total_steps=20, min_lr_ratio=0.1)
    assert [factor(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert factor(4) == pytest.approx(1.0)  # the cosine starts at the top
    assert [WarmupCosine(warmup_steps=2)(s) for s in range(5)] == [0.5, 1.0, 1.0, 1.0, 1.0]  # constant's: then flat


def test_cosine_halfway_and_floor():
    factor = WarmupCosine(warmup_steps=0, total_steps=10, min_lr_ratio=0.1)
    assert factor(5) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert factor(10) == pytest.approx(0.1)
    assert factor(50) == pytest.approx(0.1)  # past the planned end: stays at the floor, never below
    assert all(factor(s) >= factor(s + 1) for s in range(12))


def test_scheduler_steps_the_optimizer_and_round_trips():
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = warmup_cosine(optimizer, total_steps=10, warmup_steps=2, min_lr_ratio=0.0)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.5)  # step 0 of the warm-up
    for _ in range(6):
        optimizer.step()
        scheduler.step()
    saved = scheduler.state_dict()
    optimizer2 = torch.optim.SGD(model.parameters(), lr=1.0)
    restored = warmup_cosine(optimizer2, total_steps=10, warmup_steps=2, min_lr_ratio=0.0)
    restored.load_state_dict(saved)
    assert restored.get_last_lr() == scheduler.get_last_lr()
    assert restored.get_last_lr()[0] == pytest.approx(0.5 * (1 + math.cos(math.pi * 4 / 8)))


def lr_after(schedule_cfg, steps: int) -> float:
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    scheduler = schedule(OmegaConf.create(schedule_cfg), optimizer, total_steps=100)  # the planned epochs'
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
    return scheduler.get_last_lr()[0]


def test_total_steps_sets_the_decay_length_and_null_spans_the_planned_epochs():
    node = {"_target_": f"{warmup_cosine.__module__}.warmup_cosine", "_partial_": True, "warmup_steps": 0}
    node["min_lr_ratio"] = 0.1
    assert lr_after({**node, "total_steps": 40}, 40) == pytest.approx(0.1)  # at the floor after 40 steps
    assert lr_after({**node, "total_steps": None}, 40) > 0.5  # the control: the 100 planned steps, not yet halfway
    assert lr_after({**node, "total_steps": None}, 100) == pytest.approx(0.1)
