"""The LR schedule (schedule.py): linear warm-up, cosine decay to a floor, and a state that survives a checkpoint."""

import math

import pytest
import torch

from {{ cookiecutter.package }}.engine.schedule import WarmupCosine, warmup_cosine


def test_warmup_rises_linearly_to_the_peak():
    factor = WarmupCosine(warmup_steps=4, total_steps=20, min_lr_ratio=0.1)
    assert [factor(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert factor(4) == pytest.approx(1.0)  # the cosine starts at the top


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
