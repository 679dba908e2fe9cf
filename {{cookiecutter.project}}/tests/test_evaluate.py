"""Dataset-level metrics (task_results.py): a task's `metrics` returns per-class sums, `compute`
turns the split's totals into the figures; the reported figure is the one recomputed over the whole split."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from hydra.utils import instantiate

from {{ cookiecutter.package }}.engine.errors import UserError
from {{ cookiecutter.package }}.engine.task_results import check_metrics, report
from tests.datasets import MeanIoU, RngDrawingDataset
from tests.helpers import PROJECT, RNG_DATA, load_ckpt, read_jsonl, run_train

MIOU = [*RNG_DATA, "+data.val.draws=false", "epochs=1", "task._target_=tests.datasets.MeanIoU",
        "+task.num_classes=4", "checkpoint.monitor=val_miou", "loader.batch_size=10"]  # fmt: skip


def iou_over(model, samples) -> float:
    """Mean IoU over the classes present, recomputed in numpy from the predictions on `samples`."""
    x = torch.stack([s[0] for s in samples])
    with torch.no_grad():
        predicted = model.eval()(x).argmax(1).numpy()
    labels = np.array([s[1] for s in samples])
    ious = []
    for c in range(4):
        union = np.sum((predicted == c) | (labels == c))
        if union:
            ious.append(np.sum((predicted == c) & (labels == c)) / union)
    return float(np.mean(ious))


@pytest.mark.slow  # a run and eval.py; the fast tier: report() below, and test_segmentation.py's whole-split figures
def test_a_dataset_level_figure_equals_its_recomputation_from_the_final_weights(tmp_path):
    run_train(tmp_path / "run", *MIOU)
    (record,) = read_jsonl(tmp_path / "run/metrics.jsonl")
    assert {"val_miou", "val_pixel_acc"} <= record.keys() and "val_intersection" not in record
    saved = load_ckpt(tmp_path / "run/checkpoints/last.pth")
    model = instantiate(saved["config"]["model"])
    model.load_state_dict(saved["model"])
    val = RngDrawingDataset(size=64, draws=False)
    samples = [val[i] for i in range(len(val))]
    assert record["val_miou"] == pytest.approx(iou_over(model, samples), rel=1e-12)
    assert 0 < record["val_miou"] < 1
    # negative control: the mean of the per-batch figures (the run's validation batches of 10) is another number
    per_batch = np.mean([iou_over(model, samples[i : i + 10]) for i in range(0, 64, 10)])
    assert per_batch != pytest.approx(record["val_miou"], rel=1e-6)
    assert load_ckpt(tmp_path / "run/checkpoints/best.pth")["step"] == record["step"]  # kept by val_miou
    ckpt = tmp_path / "run/checkpoints/last.pth"
    subprocess.run([sys.executable, "eval.py", f"ckpt={ckpt}", f"hydra.run.dir={tmp_path / 'eval'}"], cwd=PROJECT,
                   check=True, capture_output=True, timeout=300)  # fmt: skip
    assert json.loads((tmp_path / "eval/eval.json").read_text())["val_miou"] == record["val_miou"]


def test_sums_of_any_shape_need_compute_and_its_figures_must_be_numbers():
    vector = {"hits": torch.ones(3), "count": torch.tensor(4)}
    assert check_metrics(vector, "t", computes=True) == ["hits", "count"]
    with pytest.raises(UserError, match=r"metrics\(\)\['hits'\] has shape \(3,\): a sum of that shape needs a compute"):
        check_metrics(vector, "t", computes=False)
    with pytest.raises(UserError, match="count must be one number"):
        check_metrics({"count": torch.ones(2)}, "t", computes=True)
    assert report(object(), {"acc": 3.0, "count": 4.0}, "t") == {"acc": 0.75, "count": 4.0}  # no compute: / count
    totals = {
        "intersection": torch.tensor([1.0, 0.0, 2.0]),
        "union": torch.tensor([2.0, 0.0, 4.0]),
        "count": torch.tensor(4.0),
    }
    assert report(MeanIoU(num_classes=3), totals, "t") == {"miou": 0.5, "pixel_acc": 0.75, "count": 4.0}

    class Bad:
        def compute(self, totals):
            return {"miou": torch.ones(2)}

    with pytest.raises(UserError, match=r"compute\(\)\['miou'\] must be a number"):
        report(Bad(), totals, "t")
