"""The Hydra config: every profile composes, the schema refuses typos and wrong types, bad values get one line."""

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from {{ cookiecutter.package }} import config
from {{ cookiecutter.package }}.errors import UserError
from {{ cookiecutter.package }}.loader import resolve_settings, usable_cpus
from tests.helpers import PROJECT, run_train

config.register()
PROFILES = ["memory-tight", "balanced", "throughput"]


def compose_cfg(*overrides):
    with initialize_config_dir(str(PROJECT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


@pytest.mark.parametrize("profile", PROFILES)
def test_every_profile_composes(profile):
    cfg = compose_cfg(f"loader={profile}")
    keys = {"batch_size", "num_workers", "prefetch_factor", "pin_memory", "persistent_workers", "timeout"}
    assert set(cfg.loader) >= keys
    assert cfg.seed == 0 and cfg.resume is None and cfg.max_steps is None and cfg.device.value == "auto"
    OmegaConf.to_container(cfg, resolve=True)


def test_profiles_say_what_they_trade():
    tight = resolve_settings(compose_cfg("loader=memory-tight").loader, "cpu")
    assert (tight.prefetch_factor, tight.pin_memory, tight.persistent_workers) == (1, False, False)
    balanced = resolve_settings(compose_cfg("loader=balanced").loader, "cpu")
    assert 2 <= balanced.num_workers <= 4 and balanced.prefetch_factor == 2 and balanced.persistent_workers
    fast = resolve_settings(compose_cfg("loader=throughput").loader, "cuda")
    assert fast.num_workers == usable_cpus() and fast.prefetch_factor == 4
    assert fast.pin_memory and fast.persistent_workers


@pytest.mark.parametrize("override, node, target", [
    ("optim=adamw", "optim", "torch.optim.AdamW"),
    ("optim=sgd", "optim", "torch.optim.SGD"),
    ("model=resnet18", "model", "{{ cookiecutter.package }}.model.resnet18"),
    ("data=cifar10", "data.train", "{{ cookiecutter.package }}.data.cifar10"),
    ("data=imagefolder", "data.train", "{{ cookiecutter.package }}.data.ImageFiles"),
])
def test_groups_compose(override, node, target):
    assert OmegaConf.select(compose_cfg(override), node)._target_ == target


@pytest.mark.parametrize("override", ["loader.num_worker=3", "epochs=ten", "device=gpu", "seed=1.5"])
def test_schema_refuses_typos_and_types(override):
    with pytest.raises(ConfigCompositionException):
        compose_cfg(override)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("num_workers", -1, "num_workers"),
        ("num_workers", "many", "num_workers"),
        ("batch_size", 0, "batch_size"),
        ("prefetch_factor", 0, "prefetch_factor"),
        ("pin_memory", "yes", "pin_memory"),
        ("timeout", -2, "timeout"),
    ],
)
def test_bad_loader_values_are_refused(field, value, message):
    cfg = compose_cfg()
    cfg.loader[field] = value
    with pytest.raises(UserError, match=message):
        resolve_settings(cfg.loader, "cpu")


def test_zero_workers_adjusts_instead_of_raising():
    cfg = compose_cfg("loader=throughput", "loader.num_workers=0")
    settings = resolve_settings(cfg.loader, "cpu")
    assert (settings.num_workers, settings.persistent_workers, settings.prefetch_factor) == (0, False, None)


def test_train_py_refuses_in_one_line(tmp_path):
    proc = run_train(tmp_path / "a", "loader.num_workers=-1", expect=2)
    assert proc.stderr.strip().splitlines() == ["error: loader.num_workers must be an integer >= 0 or 'auto', got -1"]
    proc = run_train(tmp_path / "b", "data=imagefolder", "data.root=/no/such/folder", "data.num_classes=3", expect=2)
    assert "does not exist" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    proc = run_train(tmp_path / "c", "loader.num_worker=3", expect=1)
    assert "num_worker" in proc.stderr
