"""engine/data_check.py's `own_draws`: a training data set that draws from a generator of its own (an augmentation
library's) is found by reading its sample 0 twice under one seed, and named; silent for torchvision's transforms
and the global generators. albumentations 2 pipelines are seeded per sample under rng_mode=per_sample
(rng.own_generators), so they are exact and do not depend on the workers; through train.py below."""

import pytest
import torch
from hydra import compose, initialize_config_dir

from {{ cookiecutter.package }}.engine import parts, schema
from {{ cookiecutter.package }}.engine.data_check import own_draws
from {{ cookiecutter.package }}.engine.loader import TrainLoader
from tests.datasets import Albumented, OwnGenerator, RngDrawingDataset, albumentations
from tests.helpers import PROJECT, RNG_DATA, load_ckpt, loader_settings, run_train, same_weights

needs_albumentations = pytest.mark.skipif(albumentations is None, reason="albumentations (the test extra)")
ALBUMENTED = [*RNG_DATA, "data.train._target_=tests.datasets.Albumented", "+data.train.seed=137", "epochs=2"]


def test_a_generator_of_the_data_sets_own_is_named_and_the_global_ones_are_not(shapes):
    line = own_draws(OwnGenerator(), "data.train", 1, per_sample=True)
    assert line.startswith("data.train (tests.datasets.OwnGenerator) gives sample 0 twice differently under the "
                           "same seed: it draws from a generator of its own"), line  # fmt: skip
    assert own_draws(RngDrawingDataset(), "data.train", 1, per_sample=True) is None  # torch, numpy, python: seeded
    schema.register()
    with initialize_config_dir(str(PROJECT / "conf"), version_base="1.3"):
        cfg = compose("config", shapes)
    shipped = parts.data_set(cfg.data, "train")  # torchvision's random crop and flip, drawing from torch's generator
    assert own_draws(shipped, "data.train", 1, per_sample=True) is None


@needs_albumentations
def test_an_albumentations_pipeline_is_seeded_per_sample_and_named_under_per_worker():
    assert own_draws(Albumented(seed=137), "data.train", 1, per_sample=True) is None
    line = own_draws(Albumented(seed=137), "data.train", 1, per_sample=False)
    assert "use rng_mode=per_sample, which seeds its pipeline per sample" in line, line
    batches = {}
    for workers in (0, 2):
        loader = TrainLoader(Albumented(48, seed=None), loader_settings(8, workers), seed=4)
        batches[workers] = torch.cat([x for x, _ in loader])
    assert torch.equal(batches[0], batches[2])  # seeded from each sample's stream: any worker count, any OS seed


@pytest.mark.slow  # four runs
@needs_albumentations
def test_albumentations_training_is_exact_across_workers_and_a_resume(tmp_path):
    run_train(tmp_path / "one", *ALBUMENTED, "loader.num_workers=1")
    proc = run_train(tmp_path / "two", *ALBUMENTED, "loader.num_workers=2")
    assert same_weights(tmp_path / "one/checkpoints/last.pth", tmp_path / "two/checkpoints/last.pth")
    assert "generator of its own" not in proc.stdout + proc.stderr
    assert load_ckpt(tmp_path / "two/checkpoints/last.pth")["nondeterministic_data"] == []
    run_train(tmp_path / "stopped", *ALBUMENTED, "loader.num_workers=2", "max_steps=7")
    run_train(tmp_path / "resumed", *ALBUMENTED, "loader.num_workers=2",
              f"resume={tmp_path}/stopped/checkpoints/last.pth")  # fmt: skip
    assert same_weights(tmp_path / "one/checkpoints/last.pth", tmp_path / "resumed/checkpoints/last.pth")


@pytest.mark.slow  # a run
def test_train_py_warns_once_and_the_checkpoint_records_it(tmp_path):
    proc = run_train(tmp_path, *RNG_DATA, "data.train._target_=tests.datasets.OwnGenerator", "max_steps=2")
    logged = proc.stdout + proc.stderr
    assert logged.count("data.train (tests.datasets.OwnGenerator) gives sample 0 twice differently") == 1, logged
    (recorded,) = load_ckpt(tmp_path / "checkpoints/last.pth")["nondeterministic_data"]
    assert recorded.startswith("data.train (tests.datasets.OwnGenerator)")
