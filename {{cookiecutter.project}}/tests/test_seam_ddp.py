"""The task seam's parts together, under torchrun: dict batches with `data.input` and an untouched uint8 side
tensor, a loss of parts, a dataset-level figure from `compute()` and a 10x head learning rate from
`optim.param_groups`, on 2 processes, with the task, data and metric of tests/datasets.py and no engine edit.
The reported figure is recomputed from the final weights, and a stop resumes exactly with another worker count."""

import pytest
import torch
from hydra.utils import instantiate

from {{ cookiecutter.package }}.model import SmallCNN
from tests.datasets import MacroRecall, SideTensorSamples
from tests.helpers import load_ckpt, read_jsonl, run_torchrun, same_weights


def node(split: str, size: int, draws: bool) -> list[str]:
    drop = [f"~data.{split}.{key}" for key in ("root", "split", "per_class", "image_size", "transform"{% if cookiecutter.with_photos == "yes" %}, "decode"{% endif %})]
    return [f"data.{split}._target_=tests.datasets.SideTensorSamples", *drop, f"+data.{split}.size={size}",
            f"+data.{split}.draws={str(draws).lower()}"]  # fmt: skip


SEAM = [
    *node("train", 128, True),
    *node("val", 64, False),
    "data.num_classes=4",
    "data.input=image",  # data.normalize takes the image alone; label and side pass as they are
    "model.width=8",
    "task._target_=tests.datasets.MacroRecall",
    "~task.label_smoothing",
    "checkpoint.monitor=val_macro_recall",
    'optim.param_groups=[{match: "head.*", lr_scale: 10}]',
    "loader=balanced",
    "loader.batch_size=8",  # per process: 16 a step on 2, 8 steps an epoch
    "epochs=2",
    "progress=false",
]


def recomputed(ckpt: dict) -> float:
    """val_macro_recall from the checkpoint's weights, in this process: the same validation samples through
    data.normalize, the model and MacroRecall, without the loop."""
    cfg = ckpt["config"]
    model = SmallCNN(num_classes=4, width=8)
    model.load_state_dict(ckpt["model"])
    normalize = instantiate(cfg["data"]["normalize"])
    val, task = SideTensorSamples(size=64, draws=False), MacroRecall()
    batch = torch.utils.data.default_collate([val[i] for i in range(len(val))])
    batch["image"] = normalize(batch["image"])
    with torch.no_grad():
        sums = task.metrics(model.eval(), batch)
    return float(task.compute({k: v.double() for k, v in sums.items()})["macro_recall"])


@pytest.mark.slow
def test_the_seam_under_torchrun_reports_the_figure_and_resumes_exactly(tmp_path):
    run_torchrun(tmp_path / "straight", *SEAM)
    straight = tmp_path / "straight/checkpoints/last.pth"
    ckpt = load_ckpt(straight)
    base = ckpt["config"]["optim"]["lr"]  # each group's own base lr, which the schedule scales
    assert [g["initial_lr"] / base for g in ckpt["optimizer"]["param_groups"]] == pytest.approx([1, 1, 10, 10])
    last = read_jsonl(tmp_path / "straight/metrics.jsonl")[-1]
    assert last["val_side_off"] == 0  # the side tensor arrived unchanged, as uint8 (else the run would have failed)
    assert last["val_macro_recall"] == pytest.approx(recomputed(ckpt), abs=1e-9)
    steps = read_jsonl(tmp_path / "straight/steps.jsonl")
    assert all("loss_ce" in line and "loss_l2" in line for line in steps)
    # stopped mid-epoch 2, resumed on 3 workers a process instead of 2
    run_torchrun(tmp_path / "first", *SEAM, "max_steps=11")
    first = tmp_path / "first/checkpoints/last.pth"
    run_torchrun(tmp_path / "second", *SEAM, "loader.num_workers=3", f"resume={first}")
    assert same_weights(straight, tmp_path / "second/checkpoints/last.pth")
    # negative controls: the recomputation sees the weights (a head that always says class 0 scores 1/4, which the
    # run beats), and a resume without the head's lr differs (resume_strict=false: the groups are this run's)
    always_first = {**ckpt, "model": {**ckpt["model"], "head.bias": torch.tensor([1e6, 0.0, 0.0, 0.0])}}
    assert recomputed(always_first) == 0.25 < last["val_macro_recall"]
    plain = [o for o in SEAM if not o.startswith("optim.param_groups")]
    run_torchrun(tmp_path / "plain", *plain, "resume_strict=false", f"resume={first}")
    assert not same_weights(straight, tmp_path / "plain/checkpoints/last.pth")
