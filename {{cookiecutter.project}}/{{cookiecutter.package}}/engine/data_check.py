"""What the engine reads of the data before a run: a data set's first readable samples (the dry step's,
the sample grid's{% if cookiecutter.with_doctor == "yes" %}, the doctor's{% endif %}), and the class names the data sets hold, checked
against each other and `data.num_classes`."""

import copy
from collections.abc import Mapping

import numpy as np
import torch

from . import rng{% if cookiecutter.with_streams == "yes" %}, shard_plan{% endif +%}
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


def own_draws(dataset, name: str, seed: int, per_sample: bool) -> str | None:
    """The warning to give when training sample 0, read twice with the generators seeded alike (as a run seeds it),
    comes out different: the data set draws from a generator of its own, which no seed of the run reaches and no
    checkpoint saves. None when both reads agree: torchvision's transforms, a data set that draws from torch's,
    numpy's or python's global generators, an albumentations pipeline under per_sample (seeded per sample). A read
    that fails is the dry step's to report."""
    pipelines = rng.own_generators(dataset) if per_sample else []
    sample_seed = rng.index_seed(rng.epoch_base(seed, 0), 0)

    def read():
        with rng.kept(cuda=False):
            rng.seed_sample(sample_seed)
            rng.seed_pipelines(pipelines, sample_seed)
{% if cookiecutter.with_streams == "yes" %}
            if shard_plan.is_stream(dataset):
                return shard_plan.first_records(dataset, 1)
{% endif %}
            return copy.copy(dataset)[0]

    try:
        if same(read(), read()):
            return None
    except Exception:
        return None
    what = f"{name} ({type(dataset).__module__}.{type(dataset).__qualname__})"
    seedable = not per_sample and rng.own_generators(dataset)  # an albumentations pipeline, under per_worker
    advice = "use rng_mode=per_sample, which seeds its pipeline per sample, or " if seedable else ""
    return (
        f"{what} gives sample 0 twice differently under the same seed: it draws from a generator of its own (an "
        f"augmentation library's?), which the run neither seeds nor saves: this run cannot be exact, nor a resume "
        f"of it; {advice}draw from torch's, numpy's or python's generators"
    )


def same(a, b) -> bool:
    """Whether two samples are equal, part by part: tensors and arrays by value, images by their bytes."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, Mapping):
        return isinstance(b, Mapping) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same, a, b))
    if hasattr(a, "tobytes"):  # a PIL image
        return type(a) is type(b) and a.tobytes() == b.tobytes()
    return bool(a == b)


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
    train, val = found.get("train"), found.get("val")
    if train and val and train != val:
        odd = sorted(set(train) ^ set(val))
        raise UserError(
            f"the train and val data hold different classes (e.g. {odd[0]!r} in only one): "
            "give both the same class folders"
        )
