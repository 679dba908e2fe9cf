"""engine/errors.py through train.py: an exception raised in your own code (a model, its __init__, a task, a
callback, a data set) shows its traceback, your frames and the calls they made, then one `error:` line saying
where, exit 1 (a data set's keeps its sample's line and exit code); bad input stays one line (exit 2), no
traceback. In the config check's dry step and during training; under torchrun rank 0 says it once."""

import pytest
import torch
from omegaconf import OmegaConf

from {{ cookiecutter.package }} import tasks
from {{ cookiecutter.package }}.engine import loader, parts
from {{ cookiecutter.package }}.engine.errors import CodeError, UserError, user_trace, yours
from {{ cookiecutter.package }}.engine.failures import EXIT_BAD_SAMPLE
from tests.helpers import RNG_DATA, run_torchrun, run_train

BUGGY = [*RNG_DATA, "model._target_=tests.datasets.BuggyModel", "~model.width", "progress=false"]


def last_line_and_trace(proc) -> tuple[str, str]:
    lines = proc.stderr.strip().splitlines()
    return lines[-1], "\n".join(lines[:-1])


def test_a_bug_in_the_model_shows_its_traceback_then_where(tmp_path):
    proc = run_train(tmp_path / "run", *BUGGY, expect=1)
    line, trace = last_line_and_trace(proc)
    assert line.startswith(
        "error: task {{ cookiecutter.package }}.tasks.Classification: loss() fails on 2 training samples with model "
        "tests.datasets.BuggyModel: RuntimeError: mat1 and mat2 shapes cannot be multiplied"
    ), proc.stderr
    assert "Traceback" in trace and "tests/datasets.py" in trace and "return x @ weight" in trace, trace
    assert "in project_features" in trace and "in forward" in trace  # the helper and the forward that called it
    assert "engine/" not in trace and not (tmp_path / "run").exists()  # the engine's frames folded; nothing written


def test_a_bug_in_a_models_init_shows_its_traceback(tmp_path):
    proc = run_train(tmp_path / "run", *RNG_DATA, "model._target_=tests.datasets.BrokenInit", "~model.width",
                     expect=1)  # fmt: skip
    line, trace = last_line_and_trace(proc)
    assert line.startswith("error: model: cannot build tests.datasets.BrokenInit: IndexError"), proc.stderr
    assert "in __init__" in trace and "[num_classes]" in trace, trace


def test_bad_input_beside_it_stays_one_line(tmp_path):
    """The control: an argument the model does not take is a config error, refused in one line (exit 2)."""
    proc = run_train(tmp_path / "run", *BUGGY, "+model.depth=3", expect=2)
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(
        "error: model: cannot build tests.datasets.BuggyModel: TypeError: "
        "BuggyModel.__init__() got an unexpected keyword argument 'depth'"
    )


@pytest.mark.slow  # a run to its first log line
def test_a_bug_in_a_callback_during_training_shows_its_traceback(tmp_path):
    proc = run_train(tmp_path / "run", *RNG_DATA, "+callbacks.bad._target_=tests.datasets.FailingCallback",
                     "log_every_steps=2", expect=1)  # fmt: skip
    line, trace = last_line_and_trace(proc)
    assert line.startswith("error: training: KeyError: 'no such figure'"), proc.stderr
    assert "in on_log" in trace and 'figures["no such figure"]' in trace, trace


@pytest.mark.slow  # two runs into training
@pytest.mark.parametrize("workers", [0, 2])
def test_a_data_sets_exception_names_the_sample_and_shows_the_workers_traceback(tmp_path, workers):
    proc = run_train(tmp_path / "run", *RNG_DATA, "data.train._target_=tests.datasets.FailsAtIndex",
                     f"loader.num_workers={workers}", expect=EXIT_BAD_SAMPLE)  # fmt: skip
    line, trace = last_line_and_trace(proc)
    assert line.startswith("error: data set index 50: ValueError: sample 50 has no label"), proc.stderr
    assert "in checked" in trace and "tests/datasets.py" in trace, trace
    skipped = run_train(tmp_path / "skip", *RNG_DATA, "data.train._target_=tests.datasets.FailsAtIndex",
                        f"loader.num_workers={workers}", "data.on_bad_sample=skip", "max_steps=20")  # fmt: skip
    assert "Traceback" not in skipped.stderr and (tmp_path / "skip/bad_samples.txt").is_file()


@pytest.mark.slow  # a torchrun start
def test_under_torchrun_rank_0_shows_it_once(tmp_path):
    proc = run_torchrun(tmp_path / "run", *BUGGY, expect=1)
    assert proc.stderr.count("error: task ") == 1 and proc.stderr.count("in project_features") == 1, proc.stderr


def test_which_frames_are_yours():
    assert yours(tasks.__file__) and yours(__file__)  # the package outside engine/, and a module of the project
    assert not yours(loader.__file__) and not yours(torch.__file__) and not yours(pytest.__file__)
    try:
        torch.zeros(2) @ torch.zeros(3)  # raised in torch, called from here
    except RuntimeError as e:
        assert "test_errors.py" in user_trace(e)


def test_a_check_of_its_arguments_is_bad_input_and_a_bug_is_not():
    """A ValueError that a class of yours raises itself, in its own frame, refuses its arguments: one line (exit 2);
    an error deeper in its code is a bug: CodeError, with the traceback."""
    with pytest.raises(UserError, match=r"^callbacks.early_stopping: cannot build .*EarlyStopping: ValueError"):
        parts.build(OmegaConf.create({"_target_": f"{tasks.__package__}.callbacks.EarlyStopping", "patience": 0}),
                    "callbacks.early_stopping")  # fmt: skip
    with pytest.raises(CodeError) as caught:
        parts.build(OmegaConf.create({"_target_": "tests.datasets.BrokenInit"}), "model")
    assert "in __init__" in caught.value.trace and str(caught.value).startswith("model: cannot build")
