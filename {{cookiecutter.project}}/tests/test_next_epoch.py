"""Persistent workers start the next epoch while validation runs (TrainLoader.start_next_epoch), and nothing changes:
the same batches, and a checkpoint taken meanwhile resumes exactly."""

import multiprocessing
import time

import pytest
import torch

from {{ cookiecutter.package }}.engine.loader import LoaderSettings, TrainLoader
from tests.datasets import RngDrawingDataset


def make(rng_mode, persistent=True):
    settings = LoaderSettings(8, 2, 2, False, persistent, 0.0)
    return TrainLoader(RngDrawingDataset(64), settings, seed=3, rng_mode=rng_mode)


def epoch(loader):
    return [x.clone() for x, _ in loader]


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("rng_mode", ["per_worker", "per_sample"])
def test_next_epoch_started_early_changes_nothing(rng_mode):
    straight = make(rng_mode)
    expected = [epoch(straight) for _ in range(3)]

    early = make(rng_mode)
    got = [epoch(early)]
    early.start_next_epoch()  # train.py: before validation
    at_boundary = early.state_dict()  # train.py: the checkpoint written after validation
    got += [epoch(early), epoch(early)]
    assert all(same(g, e) for g, e in zip(got, expected, strict=True))

    resumed = make(rng_mode)  # a resumed run starts its persistent workers early: their iterator draws a base seed
    resumed.load_state_dict(at_boundary)
    before = resumed.generator.get_state()
    resumed.start_next_epoch()
    again = resumed.state_dict()
    assert torch.equal(again["generator"], before) and not torch.equal(resumed.generator.get_state(), before)
    assert same(epoch(resumed), expected[1])
    second = make(rng_mode)
    second.load_state_dict(again)
    assert same(epoch(second), expected[1]) and same(epoch(second), expected[2])


class CountingFetches(RngDrawingDataset):
    """Counts the items workers fetch, in memory shared with the test process."""

    def __init__(self, size: int):
        super().__init__(size)
        self.fetched = multiprocessing.Value("i", 0)

    def __getitem__(self, index: int):
        with self.fetched.get_lock():
            self.fetched.value += 1
        return super().__getitem__(index)


@pytest.mark.parametrize("persistent", [False, True])
def test_only_persistent_workers_start_early(persistent):
    dataset = CountingFetches(64)
    loader = TrainLoader(dataset, LoaderSettings(8, 2, 2, False, persistent, 0.0), seed=3)
    epoch(loader)
    after_epoch = dataset.fetched.value
    loader.start_next_epoch()  # non-persistent workers exit between epochs to free memory: not restarted early
    deadline = time.monotonic() + 3
    while dataset.fetched.value == after_epoch and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (dataset.fetched.value > after_epoch) == persistent, (dataset.fetched.value, after_epoch)
