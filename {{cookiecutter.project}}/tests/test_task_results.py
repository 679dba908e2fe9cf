"""A task's `loss` may return `(loss, parts)` (task_results.py): each part is logged at log points as `loss_<name>`
in steps.jsonl, TensorBoard{% if cookiecutter.with_tracking == "yes" %} and the trackers{% endif %}; a part that is not a 0-dim tensor is refused in one line by the
dry step."""

{% if cookiecutter.with_tracking == "yes" %}
import csv

{% endif %}
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from {{ cookiecutter.package }}.engine.errors import UserError
from {{ cookiecutter.package }}.engine.task_results import check_loss, split_loss
from tests.helpers import RNG_DATA, read_jsonl, run_train

PARTED = [*RNG_DATA, "+data.val.draws=false", "epochs=1", "task._target_=tests.datasets.PartedClassification"]


@pytest.mark.slow  # the fast tier stays under 240 s on two cores (issue 50 item 7)
def test_each_part_is_logged_beside_the_loss(tmp_path, shapes_run):
    run_train(tmp_path / "parted", *PARTED, "log_every_steps=3"{% if cookiecutter.with_tracking == "yes" %}, "logger=csv"{% endif %})
    lines = read_jsonl(tmp_path / "parted/steps.jsonl")
    assert [line["step"] for line in lines] == [3, 6, 9, 12]
    for line in lines:  # the window's means: the loss is their sum, up to float rounding
        assert line["loss_l2"] > 0 and line["loss_ce"] > 0
        assert line["loss"] == pytest.approx(line["loss_ce"] + line["loss_l2"], rel=1e-6)
    events = EventAccumulator(str(tmp_path / "parted/tb")).Reload()
    logged = [(e.step, e.value) for e in events.Scalars("train/loss_ce")]
    assert logged == [(line["step"], pytest.approx(line["loss_ce"], rel=1e-6)) for line in lines]
{% if cookiecutter.with_tracking == "yes" %}
    with open(tmp_path / "parted/steps.csv") as f:
        rows = list(csv.DictReader(f))
    assert [float(r["loss_l2"]) for r in rows] == [line["loss_l2"] for line in lines]
{% endif %}
    # negative control: the plain task logs no parts (the session's shared run, conftest.py: the default task,
    # {{ cookiecutter.package }}.tasks.Classification)
    plain = read_jsonl(shapes_run / "steps.jsonl")
    assert plain and not any(key.startswith("loss_") for line in plain for key in line)


def test_the_return_forms_and_their_refusals():
    loss = torch.ones((), requires_grad=True) * 2
    assert split_loss(loss) == (loss, {})
    assert check_loss((loss, {"ce": loss.detach()}), "t") == (loss, {"ce": loss.detach()})
    refusals = [
        ((loss, {"ce": torch.ones(3)}), "task t: loss() part 'ce' must be a 0-dim tensor (e.g. the term's batch mean), "
         "got a tensor of shape (3,)"),
        ((loss, {"ce": 1.0}), "part 'ce' must be a 0-dim tensor (e.g. the term's batch mean), got float"),
        ((loss, {"a b": loss}), "task t: loss() parts need names like 'dice' (logged as loss_<name>), got 'a b'"),
        ((loss, loss, {}), "must return a scalar tensor with a gradient, or (loss, parts) with parts a dict of 0-dim "
         "tensors, got a tuple of 3"),
        (loss.detach(), "must return a scalar tensor with a gradient"),
    ]  # fmt: skip
    for result, message in refusals:
        with pytest.raises(UserError) as refused:
            check_loss(result, "t")
        assert message in str(refused.value) and "\n" not in str(refused.value)
