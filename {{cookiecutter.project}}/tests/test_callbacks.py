"""Callbacks (engine/callbacks.py, callbacks.py, conf/callbacks/): early stopping that stops a resumed run at the
same step, a stateful callback of the tests' own exact across a stop, the sample grid and HParams read back from
TensorBoard's files, weights unchanged by the shipped callbacks, a detection-style batch counted right, refusals in
one line, and docs/callbacks.md's confusion matrix run as the page gives it."""

import math
import re
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from {{ cookiecutter.package }}.callbacks import EarlyStopping
from {{ cookiecutter.package }}.engine.callbacks import SEEN, RunView
from {{ cookiecutter.package }}.sample_grid import SampleGrid, shown
from tests.helpers import load_ckpt, printed_resume, read_jsonl, run_torchrun, run_train, same_weights
from tests.test_task import FILE_BLOCK, doc_section, project_copy, run

SHIPPED = ["callbacks=[sample_grid,hparams,early_stopping]", "callbacks.sample_grid.every_epoch=true"]
# min_delta above any change of val_acc: the first validation sets the best, and every later one waits
STOPPING = ["callbacks=[early_stopping]", "callbacks.early_stopping.patience=2", "callbacks.early_stopping.min_delta=2"]
MIN_MODE = ["callbacks.early_stopping.monitor=val_loss", "callbacks.early_stopping.mode=min",
            "callbacks.early_stopping.min_delta=100"]  # fmt: skip
COUNTER = ["+callbacks.counter._target_=tests.datasets.CountingCallback"]


def judged(stopper: EarlyStopping, values: list[float]) -> list[str | None]:
    """What `stopper` answers at validations reporting `values` of its monitor, in turn."""
    return [stopper.on_validation_end(None, {stopper.monitor: v}) for v in values]


@pytest.mark.parametrize("mode", ["max", "min"])
def test_early_stopping_counts_an_improvement_in_either_mode(mode):
    sign = 1 if mode == "max" else -1  # the same story in both modes: better is higher in max, lower in min
    stopper = EarlyStopping("m", mode, patience=3)
    assert judged(stopper, [sign * v for v in (1.437, 1.5, 1.6, 1.7)]) == [None] * 4  # the first sets the best
    assert stopper.best == sign * 1.7 and stopper.waited == 0
    stopper = EarlyStopping("m", mode, patience=2, min_delta=0.05)
    answers = judged(stopper, [sign * v for v in (1.0, 1.03, 1.06, 1.08, 1.1)])  # +0.03: no; +0.06: yes
    assert answers[:4] == [None] * 4 and answers[4] == f"m has not improved on {sign * 1.06} for 2 validations"
    first = EarlyStopping("m", mode, patience=1)
    assert judged(first, [math.nan]) == ["m has not improved on None for 1 validations"] and first.best is None
    # resumed from any validation's state, the answers are those of the run that never stopped
    values = [sign * v for v in (1.0, 0.9, 1.2, 1.1, 1.3, 1.25, 1.0)]
    straight = judged(EarlyStopping("m", mode, patience=2, min_delta=0.01), values)
    assert straight.count(None) == 6 and straight[-1] is not None  # a stop at the last
    for cut in range(len(values)):
        before = EarlyStopping("m", mode, patience=2, min_delta=0.01)
        judged(before, values[:cut])
        after = EarlyStopping("m", mode, patience=2, min_delta=0.01)
        after.load_state_dict(before.state_dict())
        assert judged(after, values[cut:]) == straight[cut:]
    # the control: the other mode reads the same figures otherwise
    assert judged(EarlyStopping("m", "min" if mode == "max" else "max", patience=2, min_delta=0.01), values) != straight


@pytest.mark.slow  # 4 runs a mode: an exact resume with its control, as test_resume.py's in the fast tier
@pytest.mark.parametrize("mode", ["max", "min"])
def test_early_stopping_stops_a_resumed_run_at_the_same_step(tmp_path, shapes, mode):
    # min: val_loss, min_delta above any change of it: the first validation sets the best, and every later one waits
    stopping = STOPPING if mode == "max" else [*STOPPING, *MIN_MODE]
    run = [*shapes, "epochs=6", *stopping]  # the stop comes first, at epoch 2
    proc = run_train(tmp_path / "straight", *run)
    figure = "val_acc" if mode == "max" else "val_loss"
    assert f"stopped by callback early_stopping: {figure} has not improved" in proc.stdout + proc.stderr
    assert [r["step"] for r in read_jsonl(tmp_path / "straight/metrics.jsonl")] == [5, 10, 15]  # 2 after the best
    run_train(tmp_path / "stopped", *run, "max_steps=7")
    # the control's checkpoint (below): the stop's, with the callback's count dropped, taken before the resume
    ckpt = load_ckpt(tmp_path / "stopped/checkpoints/last.pth")
    ckpt["callbacks"]["early_stopping"] = {"best": None, "waited": 0}
    torch.save(ckpt, tmp_path / "dropped.pth")
    resume = f"resume={tmp_path}/stopped/checkpoints/last.pth"
    run_train(tmp_path / "stopped", *run, resume)
    assert [r["step"] for r in read_jsonl(tmp_path / "stopped/metrics.jsonl")] == [5, 10, 15]
    assert same_weights(tmp_path / "straight/checkpoints/last.pth", tmp_path / "stopped/checkpoints/last.pth")
    # the control: the same resume with the callback's count dropped stops later (here: 3 validations after it)
    first = load_ckpt(tmp_path / "straight/checkpoints/last.pth")["callbacks"]["early_stopping"]
    assert first["waited"] == 2
    run_train(tmp_path / "control", *run, f"resume={tmp_path}/dropped.pth")
    assert [r["step"] for r in read_jsonl(tmp_path / "control/metrics.jsonl")] == [10, 15, 20]
    if mode == "min":
        return
    # docs/resume.md's way past the stop: the printed resume= with a higher patience goes on for 2 more validations
    go_on = printed_resume(proc.stdout + proc.stderr)
    for name, patience in (("went_on", 4), ("old_patience", 2)):  # the control: the patience as it was
        unpatient = [o for o in run if ".patience=" not in o]
        done = run_train(tmp_path / name, *unpatient, f"callbacks.early_stopping.patience={patience}", *go_on)
        assert "stopped by callback early_stopping" in done.stdout + done.stderr
    assert [r["step"] for r in read_jsonl(tmp_path / "went_on/metrics.jsonl")] == [20, 25]
    assert [r["step"] for r in read_jsonl(tmp_path / "old_patience/metrics.jsonl")] == [20]


@pytest.mark.slow  # 5 runs; a callback of one's own runs in the fast tier in the docs' confusion matrix test
def test_a_callback_of_ones_own_keeps_its_state_across_a_stop(tmp_path, shapes):
    run = [*shapes, "epochs=3", "log_every_steps=2", *COUNTER]
    run_train(tmp_path / "straight", *run)
    straight = load_ckpt(tmp_path / "straight/checkpoints/last.pth")["callbacks"]["counter"]
    assert straight["validations"] == 3 and straight["logs"] == len(read_jsonl(tmp_path / "straight/steps.jsonl"))
    run_train(tmp_path / "stopped", *run, "max_steps=7")
    run_train(tmp_path / "resumed", *run, f"resume={tmp_path}/stopped/checkpoints/last.pth")
    assert load_ckpt(tmp_path / "resumed/checkpoints/last.pth")["callbacks"]["counter"] == straight
    # a resume without the callback, or with a new one, is refused in one line; resume_strict=false goes on fresh
    without = run_train(tmp_path / "without", *shapes, "epochs=3", "log_every_steps=2",
                        f"resume={tmp_path}/stopped/checkpoints/last.pth", expect=2)  # fmt: skip
    assert without.stderr.count("\n") == 1 and "saved but not configured: counter" in without.stderr
    ckpt = load_ckpt(tmp_path / "stopped/checkpoints/last.pth")
    ckpt["callbacks"] = {}
    torch.save(ckpt, tmp_path / "dropped.pth")
    run_train(tmp_path / "control", *run, f"resume={tmp_path}/dropped.pth", "resume_strict=false")
    assert load_ckpt(tmp_path / "control/checkpoints/last.pth")["callbacks"]["counter"] != straight


@pytest.mark.slow
def test_a_callback_of_ones_own_keeps_its_state_on_two_processes(tmp_path, shapes):
    run = [*shapes, "epochs=3", "log_every_steps=1", *COUNTER]
    run_torchrun(tmp_path / "straight", *run)
    run_torchrun(tmp_path / "stopped", *run, "max_steps=4")
    run_torchrun(tmp_path / "resumed", *run, f"resume={tmp_path}/stopped/checkpoints/last.pth")
    straight = load_ckpt(tmp_path / "straight/checkpoints/last.pth")
    resumed = load_ckpt(tmp_path / "resumed/checkpoints/last.pth")
    assert resumed["callbacks"]["counter"] == straight["callbacks"]["counter"]
    assert all(torch.equal(straight["model"][k], resumed["model"][k]) for k in straight["model"])


def test_the_default_callbacks_write_a_sample_grid_and_hparams(shapes_run):
    """conf/config.yaml's callbacks (sample_grid, hparams) in a plain run: the session's shared run (conftest.py)."""
    events = EventAccumulator(str(shapes_run / "tb"), size_guidance={"images": 0})
    events.Reload()
    grids = events.Images("samples/train")
    assert [g.step for g in grids] == [0]  # at the start only: every_epoch is false
    assert (grids[0].height, grids[0].width) == (2 + 2 * 34, 2 + 8 * 34)  # 16 samples of 32 px, 8 a row
    hparams = EventAccumulator(str(shapes_run / "tb/hparams"))
    hparams.Reload()
    assert b"optim.lr" in hparams.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    last = read_jsonl(shapes_run / "metrics.jsonl")[-1]["val_acc"]
    assert [s.value for s in hparams.Scalars("hparams/val_acc")] == [pytest.approx(last)]


@pytest.mark.slow  # 2 runs; the fast tier reads the default callbacks' files from the shared run (test above)
def test_the_shipped_callbacks_write_images_and_hparams_and_change_no_weight(tmp_path, shapes):
    run_train(tmp_path / "with", *shapes, *SHIPPED, "callbacks.early_stopping.patience=9")
    run_train(tmp_path / "without", *shapes, "callbacks=[]")
    assert same_weights(tmp_path / "with/checkpoints/last.pth", tmp_path / "without/checkpoints/last.pth")
    events = EventAccumulator(str(tmp_path / "with/tb"), size_guidance={"images": 0})
    events.Reload()
    grids = events.Images("samples/train")
    assert [g.step for g in grids] == [0, 5, 10]  # at the start, then after each epoch
    assert (grids[0].height, grids[0].width) == (2 + 2 * 34, 2 + 8 * 34)  # 16 samples of 32 px, 8 a row
    hparams = EventAccumulator(str(tmp_path / "with/tb/hparams"))
    hparams.Reload()
    content = hparams.PluginTagToContent("hparams")
    assert {"_hparams_/experiment", "_hparams_/session_start_info"} <= content.keys()
    assert b"optim.lr" in content["_hparams_/session_start_info"]
    last = read_jsonl(tmp_path / "with/metrics.jsonl")[-1]["val_acc"]
    assert [s.value for s in hparams.Scalars("hparams/val_acc")] == [pytest.approx(last)]
    empty = EventAccumulator(str(tmp_path / "without/tb"))
    empty.Reload()
    assert empty.Tags()["images"] == [] and not (tmp_path / "without/tb/hparams").exists()


@pytest.mark.slow  # a run each; the fast tier: the loader's count for every batch form (test_loader.py)
@pytest.mark.parametrize("collate", ["detection_collate", "reference_collate"])
def test_a_detection_batch_reports_its_real_samples_per_second(tmp_path, collate):
    """Lists of images, and torchvision's reference `tuple(zip(*batch))` (a tuple of image tuples, whose first
    image's leading size is its 3 channels): samples/s counts the 8 samples of each batch."""
    run = [
        "data.train._target_=tests.datasets.Detections", "data.val._target_=tests.datasets.Detections",
{% if cookiecutter.with_photos == "yes" %}
        *[f"~data.{split}.{key}" for split in ("train", "val") for key in ("root", "split", "per_class", "transform",
                                                                          "decode", "image_size")],
{% else %}
        *[f"~data.{split}.{key}" for split in ("train", "val") for key in ("root", "split", "per_class", "transform",
                                                                          "image_size")],
{% endif %}
        f"+data.collate._target_=tests.datasets.{collate}", "+data.collate._partial_=true",
        "model._target_=tests.datasets.PooledLinear", "~model.width", "task._target_=tests.datasets.DetectionTask",
        "~task.label_smoothing", "data.num_classes=4", "epochs=1", "loader.batch_size=8", "progress=false",
        "callbacks=[sample_grid]",
    ]  # fmt: skip
    run_train(tmp_path, *run)
    (record,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert record["samples_per_s"] * record["epoch_time_s"] == pytest.approx(64, rel=1e-6)
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"images": 0})
    events.Reload()
    (drawn,) = events.Images("samples/train")  # the images of their own sizes, padded to the largest (8 px)
    assert (drawn.height, drawn.width) == (2 + 2 * 10, 2 + 8 * 10), drawn


class AsItIs:
    """A run's `prepare` without data.normalize: the batch as it is."""

    normalize = None

    def __call__(self, batch):
        return batch


def test_the_sample_grid_draws_images_of_their_own_sizes_and_says_once_when_there_are_none(caplog):
    images = (torch.rand(3, 6, 6), torch.rand(3, 8, 7))  # torchvision's detection collate: tuples
    drawn = shown((images, ({"label": 0}, {"label": 1})), 0, None)
    assert drawn.shape == (2, 3, 8, 7) and torch.equal(drawn[0, :, 6:, :], torch.zeros(3, 2, 7))  # padded, not cut
    assert shown({"tokens": torch.zeros(2, 5, dtype=torch.long)}, "tokens", None) is None
    logged = []
    run = SimpleNamespace(world=SimpleNamespace(is_main=True), cfg=OmegaConf.create({"seed": 1, "data": {}}),
                          train_set=[(torch.zeros(5), 0)] * 4, collate=None, device=torch.device("cpu"), step=0,
                          prepare=AsItIs(), runlog=SimpleNamespace(image=logged.append))  # fmt: skip
    grid = SampleGrid(count=2)
    with caplog.at_level("INFO"):
        for epoch in range(3):
            grid.draw(run, epoch)
    assert not logged and caplog.text.count("sample_grid draws nothing") == 1, caplog.text


def test_the_sample_grid_draws_each_class_of_a_mask_over_its_image_in_one_colour():
    """Class 3 tinted half and half, the same colour in both images; 0 (background) and 255 (no class) left clear."""
    images = torch.rand(2, 3, 4, 4)
    masks = torch.zeros(2, 4, 4, dtype=torch.long)
    masks[:, :2, :2], masks[:, 3, 3], masks[1, 2, 2] = 3, 255, 5
    unit = SimpleNamespace(mean=torch.zeros(3, 1, 1), std=torch.ones(3, 1, 1))  # data.normalize, undone as is
    drawn = shown((images, masks), 0, unit)
    clear = (masks == 0) | (masks == 255)
    assert torch.equal(drawn.permute(1, 0, 2, 3)[:, clear], images.permute(1, 0, 2, 3)[:, clear])
    colour = 2 * drawn[:, :, 0, 0] - images[:, :, 0, 0]
    assert torch.allclose(colour[0], colour[1], atol=1e-6) and not torch.allclose(colour[0], images[0, :, 0, 0])
    assert not torch.allclose(2 * drawn[1, :, 2, 2] - images[1, :, 2, 2], colour[0], atol=1e-3)  # class 5: another
    assert torch.equal(shown((images, masks.float()), 0, unit), images)  # the control: a float tensor is no mask


@pytest.mark.slow  # a start of torch; the fast tier refuses the same typo in process (test_config.py)
def test_a_bad_callback_node_is_refused_in_one_line(tmp_path, shapes):
    typo = run_train(tmp_path / "typo", *shapes, *STOPPING, "+callbacks.early_stopping.patiense=2", expect=2)
    assert typo.stderr.startswith("error: callbacks.early_stopping: cannot build {{ cookiecutter.package }}.callbacks.EarlyStopping:")
    assert "unexpected keyword argument 'patiense'" in typo.stderr and typo.stderr.count("\n") == 1
    assert not (tmp_path / "typo").exists()


@pytest.mark.slow  # a start of torch for a refusal as the typo's above (the callback node is built)
def test_a_callback_that_cannot_be_built_is_refused_in_one_line(tmp_path, shapes):
    value = run_train(tmp_path / "value", *shapes, *STOPPING, "callbacks.early_stopping.patience=0", expect=2)
    assert re.match(r"error: callbacks\.early_stopping: cannot build .*EarlyStopping: .*patience >= 1", value.stderr)
    assert value.stderr.count("\n") == 1 and not (tmp_path / "value").exists()


@pytest.mark.slow  # the fast tier stays under 240 s on two cores (issue 50 item 7)
def test_the_confusion_matrix_of_the_docs_runs_as_the_page_gives_it(tmp_path):
    section = doc_section("callbacks.md", "A confusion matrix at each validation")
    files = {path: f"# {path}\n{body}" for path, body in FILE_BLOCK.findall(section)}
    assert list(files) == ["confusion.py"]
    (command,) = [line for line in section.splitlines() if line.startswith("python train.py")]
    copy = project_copy(tmp_path / "project")
    (copy / "confusion.py").write_text(files["confusion.py"])
    run(copy, command)
    (tb,) = list((copy / "outputs").glob("*/*/tb"))
    events = EventAccumulator(str(tb), size_guidance={"images": 0})
    events.Reload()
    confusion = events.Images("val/confusion")
    assert [c.step for c in confusion] == [5, 10] and (confusion[0].height, confusion[0].width) == (64, 64)


def test_a_callback_sees_the_documented_view_of_the_run_only():
    """The hooks get engine/callbacks.RunView: the names docs/callbacks.md lists, read live; nothing else, no writes."""
    run = SimpleNamespace(**dict.fromkeys(SEEN, 0), optimizer="not for callbacks")
    view = RunView(run)
    run.step = 7
    assert view.step == 7 and view.cfg == 0  # read from the run when asked
    with pytest.raises(AttributeError, match="has no 'optimizer'; it offers model, evaluated"):
        _ = view.optimizer
    with pytest.raises(AttributeError, match="read-only"):
        view.step = 8
    assert run.step == 7 and run.optimizer == "not for callbacks"  # the control: the run itself has both
