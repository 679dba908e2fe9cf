"""The Hydra config: every profile composes, the schema refuses typos and wrong types, bad values get one line."""

import dataclasses
import re
import shutil
import sys

import hydra
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import MISSING, OmegaConf

from {{ cookiecutter.package }}.data import make_shapes
from {{ cookiecutter.package }}.engine import preflight, schema
from {{ cookiecutter.package }}.engine.errors import UserError
from {{ cookiecutter.package }}.engine.loader import resolve_settings, usable_cpus
from tests.helpers import PROJECT, RNG_DATA, run_here, run_train

schema.register()
PROFILES = ["memory-tight", "balanced", "throughput"]


def compose_cfg(*overrides):
    with initialize_config_dir(str(PROJECT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


@pytest.mark.parametrize("profile", PROFILES)
def test_every_profile_composes(profile):
    cfg = compose_cfg(f"loader={profile}")
    wanted = {"batch_size", "num_workers", "prefetch_factor", "pin_memory", "persistent_workers", "timeout"}
    assert set(cfg.loader) >= wanted
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


@pytest.mark.parametrize(
    "override, node, target",
    [
        ("optim=adamw", "optim", "torch.optim.AdamW"),
        ("optim=sgd", "optim", "torch.optim.SGD"),
        ("model=resnet18", "model", "{{ cookiecutter.package }}.model.resnet18"),
        ("data=cifar10", "data.train", "{{ cookiecutter.package }}.data.cifar10"),
        ("data=imagefolder", "data.train", "{{ cookiecutter.package }}.data.ImageFiles"),
    ],
)
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
    """By the schema's ranges (preflight.check_keys), the one place they live: resolve_settings takes them checked."""
    cfg = compose_cfg()
    cfg.loader[field] = value
    with pytest.raises(UserError, match=f"loader.{message} must be"):
        preflight.check_keys(cfg)


def test_zero_workers_adjusts_instead_of_raising():
    cfg = compose_cfg("loader=throughput", "loader.num_workers=0")
    settings = resolve_settings(cfg.loader, "cpu")
    assert (settings.num_workers, settings.persistent_workers, settings.prefetch_factor) == (0, False, None)


def schema_fields(node=schema.Config, prefix=""):
    for f in dataclasses.fields(node):
        nested = dataclasses.is_dataclass(f.type)
        yield from schema_fields(f.type, f"{prefix}{f.name}.") if nested else [(prefix + f.name, f)]


def test_the_yaml_is_the_one_place_a_default_lives():
    """The schema holds types and checks, no values: a value edited in conf/ is the value the run gets."""
    cfg = compose_cfg()
    for name, f in schema_fields():
        assert f.default == MISSING, f"{name} has a default in schema.py; put it in the YAML instead"
        if name not in ("data", "model", "optim", "task", "schedule"):
            assert "check" in f.metadata, f"{name} has no range check"
            assert OmegaConf.select(cfg, name, default=MISSING) is not MISSING, f"{name} is set by no YAML file"


# Each value is refused by config.check before any work, in one line naming the key. (override, words in it)
BAD = [
    ("epochs=-1", "epochs must be an integer >= 1"),
    ("epochs=0", "epochs must be"),
    ("max_steps=0", "max_steps must be"),
    ("max_steps=-3", "max_steps must be"),
    ("seed=-1", "seed must be an integer in [0, 4294967295]"),
    ("seed=4294967296", "seed must be"),
    ("resume=''", "resume must be a non-empty string"),
    ("loader.batch_size=0", "loader.batch_size must be"),
    ("loader.num_workers=-1", "loader.num_workers must be an integer >= 0 or 'auto'"),
    ("loader.num_workers=many", "loader.num_workers must be"),
    ("loader.prefetch_factor=0", "loader.prefetch_factor must be"),
    ("loader.pin_memory=yes", "loader.pin_memory must be true, false or 'auto'"),
    ("deterministic=sometimes", "deterministic must be true, false or 'warn'"),
{% if cookiecutter.with_fsdp == "yes" %}
    ("parallel.shard_modules=3", "parallel.shard_modules must be null or a list of module class import paths"),
    ("parallel=fsdp parallel.shard_modules=[no_such.Block]", "'no_such.Block' is not an importable torch.nn.Module"),
    ("parallel=fsdp parallel.shard_modules=[torch.nn.functional.relu]", "is not an importable torch.nn.Module class"),
{% endif %}
    ("loader.timeout=-2", "loader.timeout must be"),
    ("loader.max_prefetch_mib=0", "loader.max_prefetch_mib must be a number > 0"),
    ("loader.max_prefetch_mib=-5", "loader.max_prefetch_mib must be"),
    ("schedule.warmup_steps=-1", "schedule.warmup_steps must be"),
    ("schedule.min_lr_ratio=1.5", "schedule.min_lr_ratio must be a number in [0, 1]"),
    ("schedule.min_lr_ratio=-0.1", "schedule.min_lr_ratio must be"),
    ("checkpoint.every_steps=0", "checkpoint.every_steps must be"),
    ("checkpoint.every_steps=-5", "checkpoint.every_steps must be"),
    ("checkpoint.keep=-1", "checkpoint.keep must be"),
    ("checkpoint.search_dir=''", "checkpoint.search_dir must be"),
    ("monitor.every_steps=-1", "monitor.every_steps must be"),
    ("optim.lr=-1", "optim.lr must be a number > 0"),
    ("optim.lr=0", "optim.lr must be"),
    ("optim.weight_decay=-0.1", "optim.weight_decay must be"),
    ("optim.momentum=1.5", "optim.momentum must be"),
    ("optim.momentum=0", "Nesterov momentum requires a momentum"),  # torch's own check, reached by building it
    ("+optim.momentun=0.9", "optim: cannot build torch.optim.SGD: TypeError: SGD.__init__() got an unexpected"),
    ("model.width=0", "model.width must be an integer >= 1"),
    ("model.width=-3", "model.width must be"),
    ("+model.depth=3", "model: cannot build {{ cookiecutter.package }}.model.SmallCNN: TypeError: SmallCNN.__init__()"),
    ("model._target_=torch.nn.Nope", "model: cannot build torch.nn.Nope: ModuleNotFoundError: No module named"),
    ("data.num_classes=0", "data.num_classes must be an integer >= 2"),
    ("data.num_classes=1", "data.num_classes must be"),
    ("data.image_size=0", "data.image_size must be"),
    ("data.per_class=0", "data.per_class must be"),
    ("data.root=''", "data.root must be"),
{% if cookiecutter.with_photos == "yes" %}
    ("data.decode=fast", "data.decode must be auto, pil, torchvision or gpu, got 'fast'"),
{% endif %}
    ("data.train._target_=no.such.Data", "data.train: cannot build no.such.Data: ModuleNotFoundError: No module"),
    ("+loader.num_worker=3", "unknown config key loader.num_worker (did you mean loader.num_workers?)"),
    ("+schedule.warmup=5", "schedule: cannot build {{ cookiecutter.package }}.engine.schedule.warmup_cosine: TypeError"),
    ("accumulate_steps=0", "accumulate_steps must be an integer >= 1"),
    ("val_every_steps=0", "val_every_steps must be an integer >= 1, or null"),
    ("ema.decay=1.5", "ema.decay must be a number in [0, 1], or null"),
    ("optim.grad_clip=0", "optim.grad_clip must be a number > 0, or null"),
    ("optim.decay_norm_and_bias=maybe", "optim.decay_norm_and_bias must be true or false"),
    ("data.input=-1", "data.input must be a position in the batch (an integer >= 0, 0 for (image, label))"),
    ("data.input=image", "data.input='image' is not in the batch (a list with 2 parts): set data.input to the"),
    ("optim.param_groups=3", "optim.param_groups must be a list of {match: <glob over model.named_parameters()"),
    ("optim.param_groups=[{lr_scale:2}]", "optim.param_groups must be a list of {match: <glob"),
    ("optim.param_groups=[{match:x,lr:2}]", "entry 0's lr must be one of match, lr_scale, weight_decay"),
    ("optim.param_groups=[{match:x,lr_scale:0}]", "entry 0's lr_scale must be a number > 0"),
    ("optim.param_groups=[{match:nothing}]", "optim.param_groups[0].match='nothing' matches no parameter of SmallCNN"),
    ("init_from=/no/such/file.pth", "init_from=/no/such/file.pth: no checkpoint at"),
    ("resume=no/such/last.pth", "resume: no checkpoint at"),  # through train.py: EARLY below
    ("amp=fp8", "amp must be off, bf16 or fp16"),  # through train.py: tests/test_device.py
    ("amp=true", "amp must be off, bf16 or fp16, got True"),
    ("log_every_steps=0", "log_every_steps must be an integer >= 1"),
    ("+foo=1", "unknown config key foo"),
    ("+data.per_clas=3", "data.per_clas is not used by data.train or data.val (did you mean data.per_class?)"),
    ("data=imagefolder", "data.num_classes, data.root have no value ('???' in conf/data/imagefolder.yaml)"),
    ("data=imagefolder data.num_classes=3", "data.root has no value"),
]
# a range (EARLY below: a mistyped key and a missing checkpoint through train.py as well)
FAST = {"epochs=-1"}
# Through train.py as well, one of each kind of refusal (the in-process test above checks every value with the same
# config.check that train.py runs): a range, a ratio, a choice, torch's own check, a wrong argument, a _target_
# that does not import, an added key nothing reads, a value left at ???.
THROUGH_TRAIN = FAST | {
    "+loader.num_worker=3",  # a key added with +
    "optim.param_groups=[{match:nothing}]",  # a refusal of the dry step's optimizer build
    "data=imagefolder",  # values left at ???
    "seed=4294967296",
    "model.width=0",
    "optim.lr=-1",
    "schedule.min_lr_ratio=1.5",
    "loader.pin_memory=yes",
    "optim.momentum=0",
    "+model.depth=3",
    "data.train._target_=no.such.Data",
    "+data.per_clas=3",
    "data=imagefolder data.num_classes=3",
}


@pytest.mark.parametrize("override, message", BAD, ids=[b[0] for b in BAD])
def test_check_refuses_each_bad_value(override, message):
    """In process (fast): the composed config with one bad value fails the run's check, naming the key."""
    overrides = override.split()
    cfg = compose_cfg(*overrides)
    with pytest.raises(UserError) as refused:
        check(cfg, {"data": "imagefolder" if "data=imagefolder" in overrides else "shapes"}, overrides)
    assert message in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.slow  # the fast tier stays under 240 s on two cores (issue 50 item 7)
def test_check_passes_every_shipped_choice(tmp_path):
    make_shapes(tmp_path / "folder", per_class=5, image_size=32, data_seed=1)  # an image folder of 4 classes
    for overrides in (
        [],
        ["loader=memory-tight"],
        ["loader=throughput"],
        ["optim=adamw"],
        ["model=resnet18"],
        ["model=vit"{% if cookiecutter.with_fsdp == "yes" %}, "parallel=fsdp"{% endif %}],
        ["data=imagefolder", f"data.root={tmp_path / 'folder'}", "data.num_classes=4"],
    ):
        check(compose_cfg(*overrides), {}, overrides)
    # the dry step reads the configured data: CIFAR-10, which is not on this disk, is refused in its own words
    with pytest.raises(UserError, match="no CIFAR-10 under 'data/cifar10'"):
        check(compose_cfg("data=cifar10"), {}, ["data=cifar10"])


def test_open_groups_check_the_loop_keys_always_and_the_shipped_keys_with_a_shipped_target():
    """schema.py's open groups (preflight.open_group): a `_target_` left unset is named; the keys the loop reads are
    checked whatever the target, the shipped targets' keys only with one of them (a data set of yours may mean
    otherwise)."""
    for key in ("model._target_", "data.val._target_"):
        with pytest.raises(UserError, match=f"^{re.escape(key)} is not set: the {key.split('.')[0]} group needs it"):
            preflight.check_keys(compose_cfg(f"{key}=null"))
    preflight.check_keys(compose_cfg(*RNG_DATA, "data.image_size=0"))  # a key of the shipped data sets, not yours
    with pytest.raises(UserError, match="data.image_size must be an integer >= 1, got 0"):  # control: theirs
        preflight.check_keys(compose_cfg("data.image_size=0"))
    with pytest.raises(UserError, match="data.on_bad_sample must be error or skip, got 'maybe'"):  # the loop's
        preflight.check_keys(compose_cfg(*RNG_DATA, "data.on_bad_sample=maybe"))


def check(cfg, choices, overrides):
    """What train.py checks before a run (engine/preflight.py), on a run folder that is never made."""
    try:
        preflight.check_run(cfg, PROJECT / "outputs" / "never-made", choices, overrides)
    finally:
        if torch.distributed.is_initialized():  # a sharded model's check joined a process group of one
            torch.distributed.destroy_process_group()


def refused(tmp_path, *overrides):
    """`python train.py` with bad values, run as a user runs it (from a folder of their own, default run folder):
    exit 2, one `error:` line on stderr and nothing else, nothing written (no outputs/, no data/)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir(exist_ok=True)
    proc = run_here(cwd, *overrides, expect=2, timeout=120)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert sorted(p.name for p in cwd.iterdir()) == []  # the run folder this command made is gone
    return lines[0]


@pytest.mark.parametrize(
    "override, message",
    [b for b in BAD if b[0] in FAST]
    + [pytest.param(*b, marks=pytest.mark.slow) for b in BAD if b[0] in THROUGH_TRAIN - FAST],
    ids=lambda v: str(v)[:40],
)
def test_train_py_refuses_bad_values_in_one_line(tmp_path, override, message):
    assert message in refused(tmp_path, *override.split())


@pytest.mark.slow
def test_num_classes_must_match_the_image_folder(tmp_path, shapes_root, shapes):
    make_shapes(shapes_root, per_class=40, image_size=32, data_seed=2026)  # the folder `shapes` names (4 classes)
    line = refused(tmp_path, "data=imagefolder", f"data.root={shapes_root}", "data.num_classes=5")
    assert "data.num_classes=5 but the train data holds 4 classes" in line and "set data.num_classes=4" in line
    line = refused(tmp_path, "+data.train.sizes=3", *shapes)
    assert "data.train: cannot build {{ cookiecutter.package }}.data.shapes: TypeError: shapes() got an" in line
    assert "unexpected keyword argument 'sizes'" in line


# What Hydra itself would refuse over several lines (check_command_line), and refusals of the data and of the
# checkpoint (preflight.check), through train.py only: (override, words in the line)
EARLY = [
    ("loader.num_worker=3", "unknown config key loader.num_worker (did you mean loader.num_workers?)"),
    pytest.param(  # the fast tier refuses a missing folder in process (test_segmentation.py) and this line's form above
        "data=imagefolder data.root=/no/such/folder data.num_classes=3",
        "data folder '/no/such/folder/train' does not",
        marks=pytest.mark.slow,
    ),
    # in process in the fast tier (BAD above)
    pytest.param("resume=no/such/last.pth", "resume: no checkpoint at", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("override, message", EARLY, ids=lambda v: str(v)[:40])
def test_train_py_refuses_before_hydra_writes(tmp_path, override, message):
    assert message in refused(tmp_path, *override.split())


# What Hydra reports over several lines while it composes, in one (in process: preflight.one_line_errors around a
# Hydra main, as train.py runs it).
COMPOSITION = [
    ("loader.num_worker=3", "unknown config key loader.num_worker (did you mean loader.num_workers?): the schema"),
    ("epoch=3", "unknown config key epoch (did you mean epochs?)"),
    ("hydra.run.dri=x", "unknown config key hydra.run.dri (did you mean hydra.run.dir?): Hydra's own config"),
    ("epochs=ten", "epochs=ten: Value 'ten' of type 'str' could not be converted to Integer"),
    ("device=gpu", "device=gpu: Invalid value 'gpu', expected one of [auto, cpu, cuda]"),
    ("parallel=zero3", "parallel=zero3: there is no conf/parallel/zero3.yaml; choose one of ddp{% if cookiecutter.with_fsdp == "yes" %}, fsdp{% endif %}"),
    ("loader=fast", "there is no conf/loader/fast.yaml; choose one of auto, balanced, memory-tight, throughput"),
    ("epochs=[1", "cannot read the command line: no viable alternative at input '[1'"),
    ("epochs=1,2", "Ambiguous value for argument 'epochs=1,2'"),
]


def run_main(monkeypatch, tmp_path, *argv) -> list:
    """A Hydra main over the project's conf/ (no callbacks), run through one_line_errors; the configs it got."""
    got = []

    @hydra.main(config_path=str(PROJECT / "conf"), config_name="config", version_base="1.3")
    def main(cfg):
        got.append(cfg)

    argv = [*argv, "~hydra.callbacks.checks", f"hydra.run.dir={tmp_path / 'run'}"]
    monkeypatch.setattr(sys, "argv", ["train.py", *argv])
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    preflight.one_line_errors(main)
    return got


@pytest.mark.parametrize("override, message", COMPOSITION, ids=[c[0] for c in COMPOSITION])
def test_composition_errors_are_one_line(capsys, monkeypatch, tmp_path, override, message):
    with pytest.raises(SystemExit) as stopped:
        run_main(monkeypatch, tmp_path, override)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert message in err, err
    assert len(run_main(monkeypatch, tmp_path, "epochs=3", "loader=throughput")) == 1  # a good command goes on


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.num_classes=5"], "data.num_classes=5 but the train data holds 4 classes"),
    ],
)
def test_checks_before_work_refuse_without_opening_the_data(tmp_path, overrides, message):
    """The refusals before the dry step, in process: the shapes folder is never drawn."""
    cfg = compose_cfg(f"data.root={tmp_path / 'shapes'}", *overrides)
    with pytest.raises(UserError, match=re.escape(message)):
        check(cfg, {}, overrides)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # two starts of torch; the fast tier keeps the run-folder control (the test below)
def test_the_checks_above_can_fail(tmp_path):
    """Negative controls for `refused()`: Hydra's own report of a typo is several lines (HYDRA_FULL_ERROR=0: Hydra
    reports as it does by default), and a refusal that comes from train() (the early check removed) leaves the run
    folder Hydra made."""
    proc = run_here(tmp_path, "loader.num_worker=3", expect=1, env={"HYDRA_FULL_ERROR": "0"})
    assert len(proc.stderr.strip().splitlines()) > 1 and "Could not override 'loader.num_worker'" in proc.stderr
    proc = run_here(tmp_path, "epochs=0", "~hydra.callbacks.checks", expect=2)
    assert proc.stderr.strip() == "error: epochs must be an integer >= 1, got 0"
    assert [p.name for p in (tmp_path / "outputs").glob("*/*")] != []


def test_a_refused_command_leaves_an_existing_run_folder_untouched(tmp_path, shapes_run):
    """Hydra would rewrite .hydra/config.yaml before the task runs: it writes none (hydra.output_subdir: null), and
    train.py writes its record once the checks pass."""
    run_dir = tmp_path / "run"
    shutil.copytree(shapes_run, run_dir)  # a finished run's folder (the session's shared run, copied)
    saved = {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}
    proc = run_train(run_dir, *RNG_DATA, "epochs=-1", "resume=latest", expect=2)
    assert proc.stderr.strip() == "error: epochs must be an integer >= 1, got -1"
    assert {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()} == saved
    # negative control: with Hydra writing its record, the same refusal comes after Hydra rewrote it
    run_train(run_dir, *RNG_DATA, "epochs=-1", "resume=latest", "hydra.output_subdir=.hydra", expect=2)
    assert (run_dir / ".hydra/config.yaml").read_bytes() != saved[run_dir / ".hydra/config.yaml"]
