"""Experiments (conf/experiment/), sweeps (Hydra multirun, Optuna) and run folder names, run for real."""

import importlib.util

import pytest
from hydra import compose, initialize_config_dir
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from {{ cookiecutter.package }}.data import make_shapes
from {{ cookiecutter.package }}.engine import schema
from tests.helpers import PROJECT, load_ckpt, read_jsonl, run_here, run_train

schema.register()
EXPERIMENTS = sorted(p.stem for p in (PROJECT / "conf/experiment").glob("*.yaml"))


def compose_cfg(*overrides):
    with initialize_config_dir(str(PROJECT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_composes(name):
    cfg = compose_cfg(f"experiment={name}", "data.root=/some/images", "data.num_classes=3")
    assert cfg.data.root == "/some/images"  # the command line still wins over the experiment


def test_experiments_set_what_they_say():
    debug = compose_cfg("experiment=debug")
    assert (debug.epochs, debug.loader.num_workers, debug.data.per_class) == (2, 0, 40)
    resnet = compose_cfg("experiment=resnet18_adamw", "data.root=/x", "data.num_classes=3")
    assert resnet.model._target_.endswith("resnet18") and resnet.optim._target_ == "torch.optim.AdamW"
    assert resnet.data.train._target_.endswith("ImageFiles")


@pytest.mark.slow
def test_debug_experiment_runs_and_names_its_folder(tmp_path, shapes_root):
    run_here(tmp_path, "experiment=debug", f"data.root={shapes_root}")
    (run,) = (tmp_path / "outputs").glob("*/*")
    assert run.name.endswith("_train_memory-tight_debug")  # time, script, loader profile, experiment
    assert [r["epoch"] for r in read_jsonl(run / "metrics.jsonl")] == [0, 1]
    assert list((run / "tb").glob("events.out.tfevents.*"))  # TensorBoard shows the run under this name
    assert {p.name for p in (run / "checkpoints").iterdir()} == {"last.pth", "best.pth"}


@pytest.mark.slow
def test_resnet18_adamw_experiment_on_an_image_folder(tmp_path, shapes_root):
    make_shapes(shapes_root, per_class=40, image_size=32, data_seed=2026)  # as data=shapes draws it, if missing
    # the experiment reads any folder of train/ and val/ class folders; shrink it to a 1-epoch check
    run_train(
        tmp_path / "run",
        "experiment=resnet18_adamw",
        f"data.root={shapes_root}",
        "data.num_classes=4",
        "data.image_size=32",
        "epochs=1",
        "loader.batch_size=32",
        "loader.num_workers=1",
        "progress=false",
    )
    ckpt = load_ckpt(tmp_path / "run/checkpoints/last.pth")
    assert ckpt["config"]["optim"]["_target_"] == "torch.optim.AdamW" and "layer4.1.conv2.weight" in ckpt["model"]
    assert [r["step"] for r in read_jsonl(tmp_path / "run/metrics.jsonl")] == [5]


@pytest.mark.slow
def test_multirun_gives_each_job_its_own_folder(tmp_path, shapes_root):
    sweep = tmp_path / "sweep"
    run_here(
        tmp_path,
        "-m",
        "loader=memory-tight,balanced",
        "experiment=debug",
        "epochs=1",
        f"data.root={shapes_root}",
        f"hydra.sweep.dir={sweep}",
    )
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert jobs == ["0_epochs=1,experiment=debug,loader=memory-tight", "1_epochs=1,experiment=debug,loader=balanced"]
    for job in jobs:
        assert len(read_jsonl(sweep / job / "metrics.jsonl")) == 1
        assert (sweep / job / "checkpoints/best.pth").is_file() and list((sweep / job / "tb").iterdir())
        # the HParams tab: each job a session with its settings (callbacks.HParams), side by side under the sweep
        hparams = EventAccumulator(str(sweep / job / "tb/hparams"))
        hparams.Reload()
        assert b"loader.persistent_workers" in hparams.PluginTagToContent("hparams")["_hparams_/session_start_info"]


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent is missing too: hydra_plugins comes only with a Hydra plugin
        return False


@pytest.mark.slow
@pytest.mark.skipif(
    not installed("hydra_plugins.hydra_optuna_sweeper"),
    reason="the optuna extra is not installed (pip install -e '.[optuna]')",
)
def test_optuna_sweep_runs_two_trials(tmp_path, shapes_root):
    sweep = tmp_path / "sweep"
    proc = run_here(
        tmp_path,
        "hparams_search=optuna",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.sampler.n_startup_trials=2",
        "experiment=debug",
        "epochs=1",
        f"data.root={shapes_root}",
        f"hydra.sweep.dir={sweep}",
    )
    trials = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert len(trials) == 2 and all("optim.lr=" in t.name for t in trials)
    accs = [read_jsonl(t / "metrics.jsonl")[-1]["val_acc"] for t in trials]
    results = (sweep / "optimization_results.yaml").read_text()
    assert f"best_value: {max(accs)}" in results, results  # train.py returned each trial's best val_acc
    assert "Best value" in proc.stdout + proc.stderr
