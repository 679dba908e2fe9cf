"""RNG state (rng.py): capture/apply, the checkpoint-safe form and seeding all give back the same draws."""

import random

import numpy as np
import torch

from {{ cookiecutter.package }}.engine import rng


def draw():
    return torch.rand(3), np.random.rand(3), random.random()


def same_draws(a, b) -> bool:
    return torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]


def test_capture_apply_round_trip():
    rng.seed_cpu(11)
    state = rng.capture()
    expected = draw()
    assert not same_draws(expected, draw())  # the generators moved on
    rng.apply(state)
    assert same_draws(expected, draw())


def test_from_seed_is_the_state_seed_cpu_leaves():
    for seed in (0, 5, 2**40 + 7):  # a seed above 32 bits keeps its high word in numpy
        rng.seed_cpu(seed)
        seeded = draw()
        rng.apply(rng.from_seed(seed))
        assert same_draws(seeded, draw())
    rng.apply(rng.from_seed(2**40 + 7))
    high = draw()
    rng.apply(rng.from_seed(7))
    assert not same_draws(high, draw())


def test_from_seed_matches_each_library_seeded_alone():
    seed = 2**40 + 7
    rng.apply(rng.from_seed(seed))
    expected = draw()
    random.seed(seed)
    torch.manual_seed(seed)
    got = draw()
    assert torch.equal(expected[0], got[0]) and expected[2] == got[2]


def test_saved_form_round_trips_through_a_weights_only_file(tmp_path):
    np.random.standard_normal()  # numpy caches a gaussian: part of the state
    random.gauss(0, 1)
    torch.save({"rng": rng.to_saved(rng.capture())}, tmp_path / "state.pth")
    expected = draw()
    rng.apply(rng.from_saved(torch.load(tmp_path / "state.pth", weights_only=True)["rng"]))
    assert same_draws(expected, draw())


def test_main_state_round_trip():
    saved = rng.capture_main()
    expected = draw()
    rng.seed_everything(99)
    rng.restore_main(saved)
    assert same_draws(expected, draw())


def test_a_sample_seed_depends_on_the_index_and_the_epoch_only():
    base = rng.epoch_base(7, 3)
    assert rng.index_seed(base, 1) == rng.index_seed(rng.epoch_base(7, 3), 1) < 2**64
    assert rng.index_seed(rng.epoch_base(7, 4), 1) != rng.index_seed(base, 1)  # another epoch, another seed
    assert rng.index_seed(base, 2) != rng.index_seed(base, 1)  # another index, another seed
