"""What the engine reads of the data before a run: a data set's first readable samples (the dry step's,
the sample grid's{% if cookiecutter.with_doctor == "yes" %}, the doctor's{% endif %}), and the class names the data sets hold, checked
against each other and `data.num_classes`."""

from __future__ import annotations

{% if cookiecutter.with_streams == "yes" %}
from . import shard_plan
{% endif %}
from .errors import UserError, reason, user_trace

SPARE = 8  # samples first_samples may pass over when they fail to read


def first_samples(dataset, name: str, count: int = 2) -> list:
    """The first `count` samples of `dataset` (`name`: its key). One that fails to read is passed over: a
    bad file is the training loader's to name or skip (data.on_bad_sample) at its turn. Only when the first
    `count` + SPARE all fail does this stop, in one line naming the first sample's error."""
    samples, first_error = [], None
{% if cookiecutter.with_streams == "yes" %}
    stream = shard_plan.is_stream(dataset)
    for index in [None] if stream else range(min(count + SPARE, len(dataset))):
        try:  # a stream's first records, in its own order, in one read
            samples += shard_plan.first_records(dataset, count) if stream else [dataset[index]]
{% else %}
    for index in range(min(count + SPARE, len(dataset))):
        try:
            samples.append(dataset[index])
{% endif %}
        except UserError:
            raise
        except Exception as e:
            first_error = first_error or e
        if len(samples) >= count:
            break
    if not samples and first_error is not None:
        source = getattr(dataset, "sample_source", None)
        where = f" (index 0, {source(0)})" if source{% if cookiecutter.with_streams == "yes" %} and not stream{% endif %} else ""
        error = UserError(f"{name}: reading its first samples fails{where}: {reason(first_error)}")
        error.trace = user_trace(first_error)  # shown before the line: which line of the data set raised
        raise error from None
    if not samples:
        raise UserError(f"{name} holds no samples: point it at data")
    return samples


def check_classes(found: dict, num_classes: int | None) -> None:
    """The train and val data checked to fit each other and `data.num_classes`, by `found`: split -> the
    class names its data holds (a folder data set's `classes`, or its `precheck`'s), or None where the data
    set does not say. One line before any work rather than `IndexError: Target 6 is out of bounds` mid-run."""
    found = {name: list(classes or []) for name, classes in found.items()}
    for name, classes in found.items():
        if classes and num_classes is not None and len(classes) != num_classes:
            shown = ", ".join(classes[:4]) + (", ..." if len(classes) > 4 else "")
            raise UserError(
                f"data.num_classes={num_classes} but the {name} data holds {len(classes)} classes "
                f"({shown}): set data.num_classes={len(classes)}"
            )
    if found.get("train") and found.get("val") and found["train"] != found["val"]:
        odd = sorted(set(found["train"]) ^ set(found["val"]))
        raise UserError(
            f"the train and val data hold different classes (e.g. {odd[0]!r} in only one): "
            "give both the same class folders"
        )
