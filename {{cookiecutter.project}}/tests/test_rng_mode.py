"""rng_mode=per_sample: the loader profile is a pure performance choice; the same seed gives the same weights."""

import pytest
import torch

from tests.helpers import RNG_DATA, load_ckpt, read_jsonl, run_train

SETUPS = [
    ("loader=memory-tight",),
    ("loader=balanced",),
    ("loader=throughput",),
    ("loader=balanced", "loader.num_workers=0"),
    ("loader=memory-tight", "loader.num_workers=3"),
    ("loader=throughput", "loader.num_workers=4"),
    ("loader=auto",),  # whatever it picks
]


def weights(run_dir):
    return load_ckpt(run_dir / "checkpoints/last.pth")["model"]


def equal(a, b) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def per_sample_runs(tmp_path_factory):
    runs = {}
    for setup in SETUPS:
        run_dir = tmp_path_factory.mktemp("per_sample")
        run_train(run_dir, *RNG_DATA, "epochs=2", *setup)
        runs[setup] = weights(run_dir)
        runs[setup, "val"] = [(r["val_loss"], r["val_acc"]) for r in read_jsonl(run_dir / "metrics.jsonl")]
    return runs


@pytest.mark.slow
def test_same_weights_for_every_profile_and_worker_count(per_sample_runs):
    reference = per_sample_runs[SETUPS[0]]
    for setup in SETUPS:
        assert equal(reference, per_sample_runs[setup]), setup


@pytest.mark.slow
def test_a_validation_set_that_draws_gives_the_same_figures_for_every_profile(per_sample_runs):
    """The validation samples draw noise (RngDrawingDataset) from generators seeded per sample, as the training
    samples do: the same val_loss for every profile, not those of each worker's stream (issue 56: 0.6702 with
    throughput, 0.6669 with 8 workers, from the same weights)."""
    reference = per_sample_runs[SETUPS[0], "val"]
    assert len(reference) == 2
    for setup in SETUPS:
        assert per_sample_runs[setup, "val"] == reference, setup


@pytest.mark.slow
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_same_weights_when_workers_start_by_spawn_or_forkserver(per_sample_runs, tmp_path, method):
    """Python 3.14's default on Linux is forkserver (spawn on macOS and Windows): workers get the dataset pickled
    rather than forked, and must give the weights of the fork runs above, bit for bit."""
    proc = run_train(tmp_path, *RNG_DATA, "epochs=2", "loader=balanced", start_method=method)
    assert equal(per_sample_runs[("loader=balanced",)], weights(tmp_path))
    assert "2 workers" in proc.stdout  # the loader did run workers (the health line names them)


@pytest.mark.slow
def test_same_weights_on_image_files(tmp_path, shapes):
    run_train(tmp_path / "tight", *shapes, "loader=memory-tight", "max_steps=6")
    run_train(tmp_path / "fast", *shapes, "loader=throughput", "max_steps=6")
    assert equal(weights(tmp_path / "tight"), weights(tmp_path / "fast"))


@pytest.mark.slow
def test_resume_may_switch_profile(tmp_path, per_sample_runs):
    run_train(tmp_path / "first", *RNG_DATA, "epochs=2", "loader=memory-tight", "max_steps=7")
    run_train(
        tmp_path / "second",
        *RNG_DATA,
        "epochs=2",
        "loader=throughput",
        "loader.num_workers=3",
        f"resume={tmp_path}/first/checkpoints/last.pth",
    )
    assert equal(per_sample_runs[SETUPS[0]], weights(tmp_path / "second"))


@pytest.mark.slow
def test_negative_control_per_worker_depends_on_worker_count(tmp_path):
    run_train(tmp_path / "two", *RNG_DATA, "epochs=2", "rng_mode=per_worker", "loader.num_workers=2")
    run_train(tmp_path / "three", *RNG_DATA, "epochs=2", "rng_mode=per_worker", "loader.num_workers=3")
    assert not equal(weights(tmp_path / "two"), weights(tmp_path / "three"))
