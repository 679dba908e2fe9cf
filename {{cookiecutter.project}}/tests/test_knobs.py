"""The training knobs (clipping, accumulation, EMA, mixup, init_from, the schedule group, mid-epoch validation,
a diverging loss, no decay on norms and biases, parameter groups), each exact across a stop inside its window.

Each case: a straight run, and one stopped inside the feature's window then resumed with another worker count
(rng_mode=per_sample makes that legal and exact); the weights (and EMA weights) must be torch.equal. Each has a
negative control that changes the saved state the feature relies on, or the feature itself, and must differ.
Runs: RngDrawingDataset (200 samples, batch 16: 12 micro-batches an epoch; fixed validation samples), 2 epochs.
"""

import json
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from {{ cookiecutter.package }}.engine import parts
from {{ cookiecutter.package }}.engine.errors import UserError
from {{ cookiecutter.package }}.engine.run_state import regroup
from {{ cookiecutter.package }}.model import SmallCNN
from tests.helpers import PROJECT, RNG_DATA, load_ckpt, read_jsonl, run_train, same_weights


def built_optimizer(optim: dict, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The optimizer a run builds (parts.optimizer) from the optim config `optim`."""
    return parts.optimizer(OmegaConf.create(optim), model)


BASE = [*RNG_DATA, "+data.val.draws=false", "epochs=2", "loader=balanced", "loader.num_workers=2"]
MIXUP = "+data.batch_transform={_target_: torchvision.transforms.v2.MixUp, num_classes: 4, alpha: 0.4}"

FEATURES = {
    # a stop at step 5 with accumulate_steps=3 falls in epoch 1 (4 steps an epoch), its 2nd window
    "accumulate": (("accumulate_steps=3",), 5),
    "ema": (("ema.decay=0.9",), 13),
    "clip": (("optim.grad_clip=0.5",), 13),
    "mixup": ((MIXUP, "task.label_smoothing=0.1"), 13),  # in a mixup epoch, mid-epoch
    "multistep": (("schedule=multistep", "schedule.milestones=[10,18]", "schedule.gamma=0.5"), 13),
    # stopped right after the mid-epoch validation of step 15
    "val_every": (("val_every_steps=5",), 15),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """runs(name, *extra) -> (straight run folder, the stopped one, the resumed one), trained on first use."""
    done = {}

    def get(name, *extra):
        if (name, extra) not in done:
            overrides, k = FEATURES[name]
            root = tmp_path_factory.mktemp(name)
            run_train(root / "straight", *BASE, *overrides, *extra)
            run_train(root / "first", *BASE, *overrides, *extra, f"max_steps={k}")
            run_train(root / "second", *BASE, *overrides, *extra, "loader.num_workers=3",
                      f"resume={root}/first/checkpoints/last.pth")  # fmt: skip
            done[(name, extra)] = root / "straight", root / "first", root / "second"
        return done[(name, extra)]

    return get


def resume_from(tmp_path, saved: dict, name: str, *overrides) -> object:
    """Resume from a modified checkpoint `saved` (the negative controls), with `overrides`; its run folder."""
    torch.save(saved, tmp_path / f"{name}.pth")
    run_train(tmp_path / name, *BASE, *overrides, "loader.num_workers=3", f"resume={tmp_path / name}.pth")
    return tmp_path / name


def same_ema(a, b) -> bool:
    a, b = load_ckpt(a / "checkpoints/last.pth")["ema"], load_ckpt(b / "checkpoints/last.pth")["ema"]
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FEATURES))
def test_a_stop_inside_the_features_window_resumes_exactly(runs, name):
    straight, first, second = runs(name)
    assert same_weights(straight / "checkpoints/last.pth", second / "checkpoints/last.pth")
    if name == "ema":
        assert same_ema(straight, second)
    assert load_ckpt(first / "checkpoints/last.pth")["step"] == FEATURES[name][1]
    # the resumed run's lines continue the straight run's: same steps, same validation (the val data is fixed)
    figures = ("epoch", "step", "val_loss", "val_acc")  # train_loss: a resumed epoch's covers the resumed part
    straight_lines = [{k: r[k] for k in figures} for r in read_jsonl(straight / "metrics.jsonl")]
    resumed = read_jsonl(first / "metrics.jsonl") + read_jsonl(second / "metrics.jsonl")
    assert [{k: r[k] for k in figures} for r in resumed] == straight_lines


@pytest.mark.slow
def test_accumulation_negative_control_a_window_cut_by_the_save_differs(runs, tmp_path):
    """A checkpoint one micro-batch into the next window (what a save mid-window would leave: that micro-batch's
    gradient lost) resumes elsewhere."""
    straight, first, _ = runs("accumulate")
    saved = load_ckpt(first / "checkpoints/last.pth")
    assert saved["ranks"][0]["loader"]["position"] == 3  # a window's end: saves fall on optimizer steps
    saved["ranks"][0]["loader"]["position"] = 4
    cut = resume_from(tmp_path, saved, "cut", "accumulate_steps=3")
    assert not same_weights(straight / "checkpoints/last.pth", cut / "checkpoints/last.pth")
    assert load_ckpt(straight / "checkpoints/last.pth")["step"] == 8  # step counts optimizer steps: 2 x 12 / 3


@pytest.mark.slow
def test_ema_negative_control_and_what_validation_and_eval_use(runs, tmp_path):
    straight, first, _ = runs("ema")
    saved = load_ckpt(first / "checkpoints/last.pth")
    saved["ema"] = None  # the EMA weights left out: the average restarts from the model's weights
    restarted = resume_from(tmp_path, saved, "no-ema", "ema.decay=0.9")
    assert same_weights(straight / "checkpoints/last.pth", restarted / "checkpoints/last.pth")  # training unaffected
    assert not same_ema(straight, restarted)
    # validation, best.pth and eval.py judge the EMA weights; eval.py ema=false the raw ones
    last = read_jsonl(straight / "metrics.jsonl")[-1]
    ema_eval, raw_eval = tmp_path / "eval-ema", tmp_path / "eval-raw"
    ckpt = straight / "checkpoints/last.pth"
    for folder, extra in ((ema_eval, []), (raw_eval, ["ema=false"])):
        subprocess.run([sys.executable, "eval.py", f"ckpt={ckpt}", *extra, f"hydra.run.dir={folder}"], cwd=PROJECT,
                       check=True, capture_output=True, timeout=300)  # fmt: skip
    ema_result, raw_result = (json.loads((f / "eval.json").read_text()) for f in (ema_eval, raw_eval))
    assert (ema_result["val_loss"], ema_result["weights"]) == (last["val_loss"], "ema")
    assert raw_result["weights"] == "model" and raw_result["val_loss"] != last["val_loss"]


@pytest.mark.slow
def test_clipping_logs_the_norm_and_changes_the_run(runs, tmp_path):
    straight, _, _ = runs("clip")
    lines = read_jsonl(straight / "steps.jsonl")
    assert all(line["grad_norm"] > 0 for line in lines)  # at log points only: one line per log_every_steps
    run_train(tmp_path / "unclipped", *BASE)
    assert "grad_norm" not in read_jsonl(tmp_path / "unclipped/steps.jsonl")[0]
    assert not same_weights(straight / "checkpoints/last.pth", tmp_path / "unclipped/checkpoints/last.pth")


@pytest.mark.slow
def test_mixup_is_the_same_for_every_profile_and_its_negative_control(runs, tmp_path):
    straight, _, _ = runs("mixup")
    for name, profile in (("tight", ("loader=memory-tight", "loader.num_workers=0")),
                          ("throughput", ("loader=throughput", "loader.num_workers=3"))):  # fmt: skip
        run_train(tmp_path / name, *BASE, *FEATURES["mixup"][0], *profile)
        assert same_weights(straight / "checkpoints/last.pth", tmp_path / name / "checkpoints/last.pth")
    # negative control: MixUp drawing from a counter of its own calls, which a resumed process starts again
    counted = ["+data.batch_transform._target_=tests.datasets.CallCountedMixUp", "+data.batch_transform.num_classes=4"]
    run_train(tmp_path / "counted", *BASE, *counted)
    run_train(tmp_path / "counted-first", *BASE, *counted, "max_steps=13")
    run_train(tmp_path / "counted-second", *BASE, *counted, f"resume={tmp_path}/counted-first/checkpoints/last.pth")
    assert not same_weights(tmp_path / "counted/checkpoints/last.pth", tmp_path / "counted-second/checkpoints/last.pth")


@pytest.mark.slow
def test_schedule_negative_control_a_fresh_schedule_state_differs(runs, tmp_path):
    straight, first, _ = runs("multistep")
    lrs = [(line["step"], line["lr"]) for line in read_jsonl(straight / "steps.jsonl")]
    assert lrs == [(10, 0.025), (12, 0.025), (20, 0.0125), (24, 0.0125)]  # halved at steps 10 and 18
    saved = load_ckpt(first / "checkpoints/last.pth")
    saved["scheduler"]["last_epoch"] = 0  # the schedule's position left out
    fresh = resume_from(tmp_path, saved, "fresh-schedule", *FEATURES["multistep"][0])
    assert not same_weights(straight / "checkpoints/last.pth", fresh / "checkpoints/last.pth")


@pytest.mark.slow
def test_mid_epoch_validation_leaves_the_run_as_it_is(runs, tmp_path):
    straight, first, _ = runs("val_every")
    records = read_jsonl(straight / "metrics.jsonl")
    assert [(r["step"], r.get("mid_epoch", False)) for r in records] == [
        (5, True),
        (10, True),
        (12, False),
        (15, True),
        (20, True),
        (24, False),
    ]
    assert load_ckpt(first / "checkpoints/last.pth")["step"] == 15
    run_train(tmp_path / "no-val", *BASE)
    assert same_weights(straight / "checkpoints/last.pth", tmp_path / "no-val/checkpoints/last.pth")
    # negative control: a validation that runs the model in training mode (BatchNorm's running statistics move)
    # disturbs the run when it validates mid-epoch
    drawing = ["task._target_=tests.datasets.TrainModeMetrics"]
    run_train(tmp_path / "drawing", *BASE, *drawing, "val_every_steps=5")
    run_train(tmp_path / "drawing-once", *BASE, *drawing)
    assert not same_weights(tmp_path / "drawing/checkpoints/last.pth", tmp_path / "drawing-once/checkpoints/last.pth")


@pytest.mark.slow
def test_init_from_loads_weights_only_and_resumes_exactly(runs, tmp_path):
    source, _, _ = runs("clip")
    init = [f"init_from={source}/checkpoints/last.pth"]
    straight = run_train(tmp_path / "straight", *BASE, *init)
    assert "weights only" in straight.stdout and "not a resume" in straight.stdout
    assert load_ckpt(tmp_path / "straight/checkpoints/step-00000012.pth")["step"] == 12  # a fresh step count
    run_train(tmp_path / "first", *BASE, *init, "max_steps=13")
    run_train(
        tmp_path / "second", *BASE, *init, "loader.num_workers=3", f"resume={tmp_path}/first/checkpoints/last.pth"
    )
    assert same_weights(tmp_path / "straight/checkpoints/last.pth", tmp_path / "second/checkpoints/last.pth")
    run_train(tmp_path / "fresh", *BASE)  # negative control: the same run without the weights
    assert not same_weights(tmp_path / "straight/checkpoints/last.pth", tmp_path / "fresh/checkpoints/last.pth")
    # a new head: refused in one line unless init_strict=false, which lists what it left out
    refused = run_train(tmp_path / "refused", *BASE, *init, "data.num_classes=5", expect=2)
    assert refused.stderr.strip().splitlines() == [
        f"error: init_from={source}/checkpoints/last.pth does not fit the model: other shape head.weight, head.bias; "
        "set init_strict=false to load what fits (e.g. a new head)"
    ]
    loose = run_train(tmp_path / "loose", *BASE, *init, "data.num_classes=5", "init_strict=false", "max_steps=1")
    assert "loaded 24 of 26 tensors" in loose.stdout and "other shape head.weight, head.bias" in loose.stdout


def test_a_diverging_loss_stops_in_one_line_and_keeps_finite_checkpoints(tmp_path):
    run_dir = tmp_path / "run"
    overrides = ["task._target_=tests.datasets.DivergingClassification", "+task.after=21", "checkpoint.every_steps=4"]
    proc = run_train(run_dir, *BASE, *overrides, expect=2)
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: the loss became nan or inf at step 21 (seen at step 24): stopped without saving; "
        f"{run_dir}/checkpoints/last.pth holds step 20, the last good weights: lower optim.lr or set optim.grad_clip, "
        "then resume from it with resume_strict=false"
    )
    for name in ("last.pth", "best.pth"):
        saved = load_ckpt(run_dir / "checkpoints" / name)
        assert saved["step"] == (20 if name == "last.pth" else 12)
        assert all(torch.isfinite(t).all() for t in saved["model"].values() if t.is_floating_point())


def test_no_weight_decay_on_biases_and_norm_weights_unless_asked():
    model = SmallCNN(num_classes=3, width=4)
    sgd = {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.1, "weight_decay": 0.01}
    decay, no_decay = built_optimizer({**sgd, "decay_norm_and_bias": False}, model).param_groups
    assert all(p.ndim >= 2 for p in decay["params"]) and decay["weight_decay"] == 0.01
    assert all(p.ndim < 2 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    (every,) = built_optimizer({**sgd, "decay_norm_and_bias": True}, model).param_groups  # the control: one group
    assert every["weight_decay"] == 0.01


HEAD_GROUP = 'optim.param_groups=[{match: "head.*", lr_scale: 10}]'


def test_param_groups_scale_the_lr_and_keep_no_decay_inside():
    model = SmallCNN(num_classes=3, width=4)
    sgd = {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.1, "weight_decay": 0.01}
    sgd["decay_norm_and_bias"] = False
    groups = [{"match": "head.*", "lr_scale": 10}, {"match": "head.*", "weight_decay": 0.5}, {"match": "*.0.weight"}]
    with pytest.raises(UserError, match=r"param_groups\[1\].match='head.\*' matches no parameter"):
        built_optimizer({**sgd, "param_groups": groups}, model)  # the first entry took the head
    optimizer = built_optimizer({**sgd, "param_groups": groups[::2]}, model)
    rest, rest_no_decay, head, head_no_decay, first, first_no_decay = optimizer.param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert [names[id(p)] for p in head["params"] + head_no_decay["params"]] == ["head.weight", "head.bias"]
    assert (head["lr"], head["weight_decay"], head_no_decay["lr"], head_no_decay["weight_decay"]) == (
        1.0,
        0.01,
        1.0,
        0.0,
    )
    assert all(names[id(p)].endswith(".0.weight") and p.ndim >= 2 for p in first["params"]) and first["lr"] == 0.1
    assert first_no_decay["params"] == []  # "*.0.weight" holds only convolution kernels
    assert rest["lr"] == rest_no_decay["lr"] == 0.1 and rest_no_decay["weight_decay"] == 0.0
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(model.parameters()))
    # the control: without entries, the one or two groups of before
    assert len(built_optimizer({**sgd, "param_groups": []}, model).param_groups) == 2


def test_a_resume_with_other_param_groups_carries_each_parameters_state():
    torch.manual_seed(0)
    model = SmallCNN(num_classes=3, width=4)
    adamw = {"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 0.01, "weight_decay": 0.01}
    adamw |= {"decay_norm_and_bias": False, "param_groups": []}
    before = built_optimizer(adamw, model)
    model(torch.rand(2, 3, 16, 16)).sum().backward()
    before.step()
    ckpt = {"optimizer": before.state_dict(), "config": {"optim": adamw}}
    regrouped = {**adamw, "param_groups": [{"match": "head.*", "lr_scale": 10}]}
    with pytest.raises(ValueError, match="different number of parameter groups"):  # the control: torch's own load
        built_optimizer(regrouped, model).load_state_dict(ckpt["optimizer"])
    after = built_optimizer(regrouped, model)
    regroup(ckpt["optimizer"], ckpt, model, after)
    for p in model.parameters():
        assert torch.equal(after.state[p]["exp_avg"], before.state[p]["exp_avg"]) and after.state[p] is not None
    names = {id(p): n for n, p in model.named_parameters()}
    lrs = {names[id(p)]: g["lr"] for g in after.param_groups for p in g["params"]}
    assert lrs["head.weight"] == lrs["head.bias"] == pytest.approx(0.1) and lrs["features.0.0.weight"] == 0.01


@pytest.mark.slow
def test_param_groups_resume_exactly(tmp_path):
    run_train(tmp_path / "straight", *BASE, HEAD_GROUP)
    run_train(tmp_path / "first", *BASE, HEAD_GROUP, "max_steps=13")
    run_train(tmp_path / "second", *BASE, HEAD_GROUP, "loader.num_workers=3",
              f"resume={tmp_path}/first/checkpoints/last.pth")  # fmt: skip
    straight = tmp_path / "straight/checkpoints/last.pth"
    assert same_weights(straight, tmp_path / "second/checkpoints/last.pth")
    saved = load_ckpt(tmp_path / "first/checkpoints/last.pth")
    assert [g["initial_lr"] for g in saved["optimizer"]["param_groups"]] == [0.05, 0.05, 0.5, 0.5]
    # negative control: a schedule that forgot the head's own base lr (the default's for every group)
    saved["scheduler"]["base_lrs"] = [0.05] * 4
    forgot = resume_from(tmp_path, saved, "forgot", HEAD_GROUP)
    assert not same_weights(straight, forgot / "checkpoints/last.pth")
    # resume_strict=false without the head's group: each parameter's state carried over, in one log line
    run_train(tmp_path / "regrouped", *BASE, "resume_strict=false", f"resume={tmp_path}/first/checkpoints/last.pth")
    assert "the parameters are grouped otherwise" in (tmp_path / "regrouped/train.log").read_text()
