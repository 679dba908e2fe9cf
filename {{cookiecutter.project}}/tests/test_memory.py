"""The prefetch plan and the memory budget: bytes of a real batch, what the budget lowers first, and a refusal."""

import random

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from torch.utils.data import default_collate

from {{ cookiecutter.package }}.engine import memory, schema
from {{ cookiecutter.package }}.engine.errors import UserError
from tests.datasets import RngDrawingDataset
from tests.helpers import PROJECT, RNG_DATA, loader_settings, run_train

MiB = 2**20


def test_plan_counts_every_tensor_of_a_real_batch():
    dataset = RngDrawingDataset(64, image_size=16)
    batch = default_collate([dataset[i] for i in range(16)])
    one = 16 * 3 * 16 * 16 * 4 + 16 * 8  # float32 images + int64 labels
    assert memory.batch_bytes(batch) == one
    assert memory.batch_bytes({"x": batch[0], "more": [batch[1], np.zeros(10, np.float64)], "name": "a"}) == one + 80
    plan = memory.plan(batch, loader_settings(16, 3, prefetch=2))
    assert (plan.in_flight, plan.pinned_copies, plan.bytes) == (6, 0, 6 * one)
    pinned = memory.plan(batch, loader_settings(16, 3, prefetch=2, pin=True))
    assert (pinned.in_flight, pinned.pinned_copies, pinned.bytes) == (6, 6, 12 * one)
    assert memory.plan(batch, loader_settings(16, 0)).bytes == 0
    line = plan.line()
    assert "prefetch" in line and "MiB" in line and "16x3x16x16 float32" in line
    assert "3 workers x prefetch_factor 2" in line


def test_batch_size_is_estimated_before_the_workers_without_touching_the_main_rng():
    dataset = RngDrawingDataset(64, image_size=16)  # its items draw from torch, numpy and python random
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    before = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    estimate = memory.sample_batch_bytes(dataset, 16)
    assert estimate == memory.batch_bytes(default_collate([dataset[i] for i in range(16)]))
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    memory.sample_batch_bytes(dataset, 16)
    after = (torch.get_rng_state(), np.random.get_state()[1], random.getstate())
    assert torch.equal(before[0], after[0]) and np.array_equal(before[1], after[1]) and before[2] == after[2]


def test_budget_lowers_prefetch_first_then_workers_and_says_so():
    big = loader_settings(16, 4, prefetch=4)  # 16 batches of 1 MiB in flight
    assert memory.fit(big, MiB, 32) == (big, [])
    assert memory.fit(big, MiB, None) == (big, [])

    fitted, [note] = memory.fit(big, MiB, 8)  # 8 batches fit: 4 workers x 2
    assert (fitted.num_workers, fitted.prefetch_factor) == (4, 2)
    assert "prefetch_factor 4 -> 2 (8.0 MiB)" in note and "num_workers" not in note

    fitted, [note] = memory.fit(big, MiB, 3.5)  # fewer batches than workers: one each, three workers
    assert (fitted.num_workers, fitted.prefetch_factor, fitted.persistent_workers) == (3, 1, True)
    assert "prefetch_factor 4 -> 1" in note and "num_workers 4 -> 3" in note

    fitted, [note] = memory.fit(big, MiB, 0.5)  # not even one batch: the main process loads
    assert (fitted.num_workers, fitted.prefetch_factor, fitted.persistent_workers) == (0, None, False)
    assert "num_workers 4 -> 0" in note and "main process" in note

    fitted, _ = memory.fit(loader_settings(16, 4, prefetch=4, pin=True), MiB, 8)  # pinned copies count double
    assert (fitted.num_workers, fitted.prefetch_factor) == (4, 1)
    assert memory.Plan(fitted, MiB).mib <= 8


def test_budget_error_refuses_in_one_line():
    with pytest.raises(UserError, match="max_prefetch_mib=8") as caught:
        memory.fit(loader_settings(16, 4, prefetch=4), MiB, 8, on_budget="error")
    assert "\n" not in str(caught.value) and "on_budget=adjust" in str(caught.value)


@pytest.mark.slow
def test_train_py_refuses_over_budget_with_on_budget_error(tmp_path):
    proc = run_train(tmp_path, *RNG_DATA, "loader.max_prefetch_mib=0.01", "loader.on_budget=error", expect=2)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: loader: the prefetch plan needs 0.2 MiB"), lines


@pytest.mark.slow
def test_train_py_adjusts_to_the_budget_and_logs_the_plan(tmp_path):
    # one RNG_DATA batch is 16 x 3x16x16 float32 + 16 int64 = 48.1 KiB; balanced holds 4 (0.19 MiB), 0.1 MiB holds 2
    proc = run_train(tmp_path, *RNG_DATA, "loader.max_prefetch_mib=0.1", "max_steps=4")
    out = proc.stdout + proc.stderr
    over = "loader: the prefetch plan needs 0.2 MiB (2 workers x prefetch_factor 2 x 0.05 MiB per batch), over "
    assert over + "loader.max_prefetch_mib=0.1: prefetch_factor 2 -> 1 (0.1 MiB)" in out
    assert "x 2 batches in flight (2 workers x prefetch_factor 1) = 0.1 MiB" in out


def test_builtin_image_data_is_planned_at_its_uint8_size(shapes_root):
    schema.register()
    with initialize_config_dir(str(PROJECT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"data.root={shapes_root}", "data.per_class=40"])
    train_set = instantiate(cfg.data.train)
    one = 64 * (3 * 32 * 32 * 1 + 8)  # uint8 pixels + int64 labels: a quarter of the float32 bytes
    assert memory.sample_batch_bytes(train_set, 64) == one
    batch = default_collate([train_set[i] for i in range(64)])
    line = memory.plan(batch, loader_settings(64, 2)).line()
    assert "64x3x32x32 uint8" in line and f"{one / MiB:.2f} MiB" in line


def test_the_plan_line_counts_the_tensors_of_a_detection_batch():
    """torchvision's detection batches hold a tensor a sample (images of their own sizes, a dict of boxes and labels
    each): the line counts them by kind with each size's range, not 24 shapes one by one; a plain batch is listed."""
    images = tuple(torch.zeros(3, 6 + i % 3, 6 + i % 3) for i in range(8))
    targets = tuple({"boxes": torch.zeros(1 + i % 3, 4), "labels": torch.zeros(1 + i % 3, dtype=torch.long)}
                    for i in range(8))  # fmt: skip
    assert memory.layout((images, targets)) == (
        "24 tensors: 8 x 3x6-8x6-8 float32, boxes: 8 x 1-3x4 float32, labels: 8 x 1-3 int64"
    )
    assert memory.layout((torch.zeros(64, 3, 32, 32, dtype=torch.uint8), torch.zeros(64, dtype=torch.long))) == (
        "64x3x32x32 uint8, 64 int64"
    )
