"""Segmentation (data=segmentation, task=segmentation, model=unet, experiment=segmentation): the mask moves with the
image and stays class indices, mIoU and pixel accuracy come from the split's counts, a folder missing a piece is
refused in one line, and `python train.py experiment=segmentation` learns, evaluates and resumes exactly."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from PIL import Image
from torchvision.transforms import v2

from {{ cookiecutter.package }}.data import IGNORE, SegmentationFolder, ignore_edge
from {{ cookiecutter.package }}.engine import preflight, schema
from {{ cookiecutter.package }}.engine.device import input_transform
from {{ cookiecutter.package }}.engine.errors import UserError
from {{ cookiecutter.package }}.tasks import Segmentation
from tests.helpers import PROJECT, load_ckpt, read_jsonl, run_train, same_weights
from tests.test_task import COMMANDS, FILE_BLOCK, doc_section, project_copy

COLOUR = (200, 40, 90)  # the shape's colour in the hand-made pairs, far from their grey background
LABEL = 3


def compose_cfg(*overrides):
    schema.register()
    with initialize_config_dir(str(PROJECT / "conf"), version_base="1.3"):
        return compose("config", overrides=["experiment=segmentation", *overrides])


def write_pairs(root, split: str = "train", count: int = 1, size=(24, 16)) -> None:
    """`count` pairs of a COLOUR rectangle in the upper left of a grey image (so a flip or a crop shows), its mask
    LABEL inside, IGNORE on its edge, 0 elsewhere."""
    (root / split / "images").mkdir(parents=True, exist_ok=True)
    (root / split / "masks").mkdir(parents=True, exist_ok=True)
    w, h = size
    for i in range(count):
        image, mask = np.full((h, w, 3), 60, np.uint8), np.zeros((h, w), np.uint8)
        image[2 : h // 2 + i, 3 : w // 3 + 2] = COLOUR
        mask[2 : h // 2 + i, 3 : w // 3 + 2] = LABEL
        Image.fromarray(image).save(root / split / "images" / f"p{i}.png")
        Image.fromarray(ignore_edge(mask)).save(root / split / "masks" / f"p{i}.png")


def shape_pixels(image: torch.Tensor, tolerance: int = 0) -> torch.Tensor:
    """(H, W) bool: the pixels of `image` that show the shape's colour."""
    return ((image.int() - torch.tensor(COLOUR)[:, None, None]).abs() <= tolerance).all(0)


def aligned(image: torch.Tensor, mask: torch.Tensor) -> bool:
    """Every pixel off the edge shows the shape exactly where the mask says LABEL."""
    valid = mask != IGNORE
    return torch.equal(shape_pixels(image)[valid], (mask == LABEL)[valid])


def test_the_mask_moves_with_the_image_and_stays_class_indices(tmp_path):
    write_pairs(tmp_path)
    # a crop and a flip (no resize): the image's pixels stay exact, so alignment is checked pixel for pixel
    crop_flip = v2.Compose([v2.RandomCrop((12, 16)), v2.RandomHorizontalFlip(), v2.RandomVerticalFlip()])
    data = SegmentationFolder(tmp_path, "train", transform=crop_flip, num_classes=4)
    samples = []
    for seed in range(12):
        torch.manual_seed(seed)
        samples.append(data[0])
    assert all(aligned(image, mask) for image, mask in samples)
    assert len({mask.numpy().tobytes() for _, mask in samples}) > 4  # the draws moved the shape about
    image, mask = samples[0]
    assert (image.dtype, image.shape, mask.dtype, mask.shape) == (torch.uint8, (3, 12, 16), torch.int64, (12, 16))
    # negative control: the same transform drawn apart for the image and the mask misaligns them
    plain = SegmentationFolder(tmp_path, "train")
    image, mask = plain[0]
    assert aligned(image, mask)
    torch.manual_seed(0)
    apart = [(crop_flip(image), crop_flip(mask)) for _ in range(6)]
    assert not all(aligned(i, m) for i, m in apart)

    # the YAML's own training transform (RandomResizedCrop, flip): the mask takes its nearest pixel, never a blend
    cfg = compose_cfg(f"data.root={tmp_path}", "data.generate=false")
    data = SegmentationFolder(tmp_path, "train", transform=instantiate(cfg.data.train.transform))
    for seed in range(8):
        torch.manual_seed(seed)
        image, mask = data[0]
        assert image.shape == (3, 32, 32) and mask.dtype == torch.int64
        assert set(mask.unique().tolist()) <= {0, LABEL, IGNORE}  # bilinear would blend 3 and 255 into others
        shown = shape_pixels(image, tolerance=2)
        assert shown[mask == LABEL].all() and (mask[shown] != 0).all()
    # negative control: the image flipped alone no longer shows the shape where the mask says
    assert not shape_pixels(image.flip(-1), tolerance=2)[mask == LABEL].all()

    # data.normalize takes the image (data.input=0) alone: the mask reaches the task as it left the data set
    prepare = input_transform(cfg.data, torch.device("cpu"))
    images, masks = torch.stack([image, image]), torch.stack([mask, mask])
    out_images, out_masks = prepare((images, masks))
    assert out_masks.dtype == torch.int64 and torch.equal(out_masks, masks)
    # control: the same call does change what it normalizes
    assert out_images.dtype == torch.float32 and not torch.equal(out_images, images.float())


def per_class_iou(truth: np.ndarray, pred: np.ndarray, num_classes: int) -> dict[int, float]:
    """IoU by class from the pixels themselves, ignore pixels dropped; classes in neither left out."""
    keep = truth != IGNORE
    truth, pred = truth[keep], pred[keep]
    ious = {}
    for c in range(num_classes):
        union = ((truth == c) | (pred == c)).sum()
        if union:
            ious[c] = ((truth == c) & (pred == c)).sum() / union
    return ious


class Fixed(torch.nn.Module):
    """A model whose logits put each pixel on the class `pred` gives it, whatever the images."""

    def __init__(self, pred: torch.Tensor, num_classes: int):
        super().__init__()
        self.logits = 4.0 * F.one_hot(pred, num_classes).permute(0, 3, 1, 2).float()

    def forward(self, images):
        return self.logits


def figures(task, pred, truth):
    """compute() over the totals of metrics() on the batches (pred, truth) given, as validation adds them up."""
    totals = {}
    for p, t in zip(pred, truth):
        metrics = task.metrics(Fixed(p, task.num_classes), (torch.zeros(len(t), 3, *t.shape[1:]), t))
        totals = {k: totals.get(k, 0) + v.double() for k, v in metrics.items()}
    return task.compute(totals)


def test_miou_and_pixel_accuracy_come_from_the_splits_counts():
    task = Segmentation(num_classes=4)  # class 3 is in neither the masks nor the predictions
    truth = torch.tensor([[[0, 0, 1, IGNORE]], [[1, 1, 2, 2]]])
    pred = torch.tensor([[[0, 1, 1, 2]], [[1, 0, 2, 2]]])  # the 2 under IGNORE counts nowhere
    ious = per_class_iou(truth.numpy(), pred.numpy(), 4)
    assert sorted(ious) == [0, 1, 2] and [ious[c] for c in (0, 1, 2)] == [1 / 3, 0.5, 1.0]
    whole = figures(task, [pred], [truth])
    assert whole["miou"] == pytest.approx(np.mean(list(ious.values()))) == pytest.approx(11 / 18)
    assert whole["pixel_acc"] == pytest.approx(5 / 7)  # 5 of the 7 pixels that are not IGNORE
    logits = Fixed(pred, 4).logits
    assert whole["loss"] == pytest.approx(F.cross_entropy(logits, truth, ignore_index=IGNORE).item())
    # the same split in two batches (one image each) gives the same figures: they come from the summed counts
    halves = figures(task, [pred[:1], pred[1:]], [truth[:1], truth[1:]])
    assert halves == pytest.approx(whole)
    # negative controls: the mean of the batches' mIoU, class 3 counted as IoU 0, and the IGNORE pixel counted as
    # background each give another figure, so the checks above can fail
    batch_mean = np.mean([figures(task, [pred[i : i + 1]], [truth[i : i + 1]])["miou"] for i in range(2)])
    assert batch_mean == pytest.approx(0.5) and batch_mean != pytest.approx(whole["miou"])
    assert np.mean([*ious.values(), 0.0]) != pytest.approx(whole["miou"])
    counted = figures(task, [pred], [torch.where(truth == IGNORE, 0, truth)])
    assert counted["pixel_acc"] == pytest.approx(5 / 8) and counted["miou"] != pytest.approx(whole["miou"])


def test_a_folder_missing_a_piece_is_refused_in_one_line(tmp_path):
    def refused(root) -> str:
        cfg = compose_cfg(f"data.root={root}", "data.generate=false")
        with pytest.raises(UserError) as e:
            preflight.precheck_data(cfg)
        return str(e.value)

    assert "does not exist" in refused(tmp_path / "nothing")
    write_pairs(tmp_path / "pairs", "train", count=3)
    assert f"data folder '{tmp_path / 'pairs/val'}' does not exist" in refused(tmp_path / "pairs")
    (tmp_path / "pairs/val/images").mkdir(parents=True)
    assert f"no masks/ folder in '{tmp_path / 'pairs/val'}'" in refused(tmp_path / "pairs")
    write_pairs(tmp_path / "pairs", "val", count=2)
    preflight.precheck_data(compose_cfg(f"data.root={tmp_path / 'pairs'}", "data.generate=false"))  # complete: passes
    (tmp_path / "pairs/val/masks/p1.png").unlink()
    assert refused(tmp_path / "pairs") == (
        f"1 of the 2 images in '{tmp_path / 'pairs/val/images'}' have no mask (first: "
        f"'{tmp_path / 'pairs/val/masks/p1.png'}'): give every image a mask of the same name, or take the image out"
    )


def test_a_folder_of_pairs_is_read_as_it_is_with_generate_on(tmp_path):
    """data.generate=true (the default) draws only into a new or empty folder: a folder of pairs is your data, read
    and never written; any other folder is refused in one line, untouched."""
    write_pairs(tmp_path / "pairs", "train", count=3)
    write_pairs(tmp_path / "pairs", "val", count=2)
    before = sorted((p, p.stat().st_mtime_ns) for p in (tmp_path / "pairs").rglob("*"))
    cfg = compose_cfg(f"data.root={tmp_path / 'pairs'}")
    assert cfg.data.generate is True
    preflight.precheck_data(cfg)
    data = instantiate(cfg.data.train, transform=None)
    assert len(data) == 3 and LABEL in data[0][1].unique().tolist()  # the pairs' own masks
    assert sorted((p, p.stat().st_mtime_ns) for p in (tmp_path / "pairs").rglob("*")) == before
    (tmp_path / "empty").mkdir()  # an empty folder: the shapes are drawn into it
    shapes = instantiate(compose_cfg(f"data.root={tmp_path / 'empty'}", "data.per_class=2").data.train, transform=None)
    assert len(shapes) == 2 * 4 and (tmp_path / "empty/shapes.json").is_file()
    (tmp_path / "other").mkdir()  # the control: a folder holding something else
    (tmp_path / "other/notes.txt").write_text("mine")
    error = refused_generate(tmp_path / "other")
    assert "is not a generated shapes folder" in error and "<split>/images and <split>/masks pairs" in error
    assert [p.name for p in (tmp_path / "other").iterdir()] == ["notes.txt"]


@pytest.mark.slow  # a start of torch; the fast tier's refusals through train.py are test_config.py's
def test_train_py_refuses_an_image_without_its_mask_in_one_line(tmp_path):
    """train.py: the refusal above as one `error:` line, exit 2, before any run folder is written."""
    write_pairs(tmp_path / "pairs", "train", count=3)
    write_pairs(tmp_path / "pairs", "val", count=2)
    (tmp_path / "pairs/val/masks/p1.png").unlink()
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "train.py", "experiment=segmentation", f"data.root={tmp_path / 'pairs'}",
           "data.generate=false", f"hydra.run.dir={run_dir}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=PROJECT, capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: 1 of the 2 images"), proc.stderr
    assert not run_dir.exists()


def refused_generate(root) -> str:
    with pytest.raises(UserError) as e:
        preflight.precheck_data(compose_cfg(f"data.root={root}"))
    return str(e.value)


SMALL = ["data.per_class=40", "epochs=3", "loader.batch_size=8", "progress=false"]  # 20 steps an epoch


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """`python train.py experiment=segmentation`, shrunk: 160 generated training pairs, 3 epochs of 20 steps."""
    root = tmp_path_factory.mktemp("segdata") / "segshapes"
    run_dir = tmp_path_factory.mktemp("segrun")
    run_train(run_dir, "experiment=segmentation", f"data.root={root}", *SMALL)
    return run_dir, root


def background_miou(root) -> float:
    """The val mIoU of predicting background everywhere, from the mask files: IoU of class 0 over the classes
    present (every other class present scores 0)."""
    masks = np.stack([np.array(Image.open(p)) for p in sorted((root / "val/masks").glob("*.png"))])
    valid = masks[masks != IGNORE]
    present = set(np.unique(valid).tolist()) | {0}
    return (valid == 0).sum() / valid.size / len(present)


@pytest.mark.slow
def test_the_experiment_learns_keeps_the_best_miou_and_evaluates_to_its_last_figures(tmp_path, trained):
    run_dir, root = trained
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["epoch"] for r in records] == [0, 1, 2]
    assert all({"val_miou", "val_pixel_acc", "val_loss"} <= r.keys() and "val_acc" not in r for r in records)
    baseline = background_miou(root)
    assert 0.1 < baseline < 0.25 and records[-1]["val_miou"] > baseline + 0.05
    best = load_ckpt(run_dir / "checkpoints/best.pth")
    expected = next(r for r in records if r["val_miou"] == max(r["val_miou"] for r in records))
    assert best["best"] == {"monitor": "val_miou", "mode": "max", "value": expected["val_miou"]}
    assert best["metrics"] == expected
    # eval.py on the last checkpoint: the run's last validation, exactly
    cmd = [sys.executable, "eval.py", f"ckpt={run_dir}/checkpoints/last.pth", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=PROJECT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "eval.json").read_text())
    names = ("val_loss", "val_miou", "val_pixel_acc")
    assert [result[k] for k in names] == [records[-1][k] for k in names]
    assert [result[k] for k in names] != [records[0][k] for k in names]  # control: the epochs' figures differ


@pytest.mark.slow
def test_the_experiment_resumes_exactly_with_another_worker_count(tmp_path, trained):
    run_dir, root = trained
    first, second, third = tmp_path / "first", tmp_path / "second", tmp_path / "third"
    run_train(first, "experiment=segmentation", f"data.root={root}", *SMALL, "max_steps=27")  # mid-epoch 1
    resumed = [f"resume={first}/checkpoints/last.pth", "loader.num_workers=1"]
    run_train(second, "experiment=segmentation", f"data.root={root}", *SMALL, *resumed)
    assert same_weights(run_dir / "checkpoints/last.pth", second / "checkpoints/last.pth")
    # negative control: resumed from the start of the stopped epoch (as if the loader position were lost)
    ckpt = load_ckpt(first / "checkpoints/last.pth")
    assert ckpt["ranks"][0]["loader"]["position"] == 7
    ckpt["ranks"][0]["loader"]["position"] = 0
    torch.save(ckpt, tmp_path / "restarted-epoch.pth")
    restarted = [f"resume={tmp_path / 'restarted-epoch.pth'}", "loader.num_workers=1"]
    run_train(third, "experiment=segmentation", f"data.root={root}", *SMALL, *restarted)
    assert not same_weights(run_dir / "checkpoints/last.pth", third / "checkpoints/last.pth")


@pytest.mark.slow
def test_the_readmes_torchmetrics_task_runs_under_torchrun_and_agrees_with_the_built_in_one(tmp_path, trained):
    """The torchmetrics example of docs/your-own-task.md, copied out: 2 ranks, each validating its share into the
    metric object that torchmetrics gathers; its val_miou is the built-in task's over the whole split (eval.py, one
    process)."""
    pytest.importorskip("torchmetrics", reason="the test extra brings torchmetrics (pip install -e '.[test]')")
    _, root = trained
    copy = project_copy(tmp_path / "copy")
    section = doc_section("your-own-task.md", "Segmentation")
    for path, body in FILE_BLOCK.findall(section):
        (copy / path).write_text(f"# {path}\n{body}")
    (command,) = [line for block in COMMANDS.findall(section) for line in block.splitlines() if "torchrun" in line]
    argv = command.split("#")[0].split()
    assert argv[:3] == ["torchrun", "--nproc_per_node=2", "train.py"], command
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py"]
    run_dir = tmp_path / "tm"
    train = [*launcher, *argv[3:], f"data.root={root}", *SMALL, "epochs=2", f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(train, cwd=copy, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_jsonl(run_dir / "metrics.jsonl")
    cmd = [sys.executable, "eval.py", f"ckpt={run_dir}/checkpoints/last.pth", "task=segmentation",
           f"hydra.run.dir={tmp_path / 'eval'}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=copy, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    built_in = json.loads((tmp_path / "eval/eval.json").read_text())["val_miou"]
    assert records[-1]["val_miou"] == pytest.approx(built_in, abs=1e-6)
    assert records[0]["val_miou"] != pytest.approx(built_in, abs=1e-6)  # control: another epoch's figure differs
