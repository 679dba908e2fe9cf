"""Your own task (docs/your-own-task.md): the worked example, copied out of that page and run as it says.

A copy of the project gets the page's files (a data set of dicts, an MLP, a regression task and their three
YAML files), then trains, evaluates and resumes through the unchanged train.py and eval.py. The task seam's
other checks: a metrics() without `count`, a monitor the task does not report, an argument its target does not
take, and an op without a deterministic kernel are each refused in one line before the run folder is written.
"""

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.helpers import PROJECT, RNG_DATA, load_ckpt, read_jsonl, same_weights

FILE_BLOCK = re.compile(r"```(?:python|yaml)\n# ([\w/.-]+\.(?:py|yaml))\n(.*?)```", re.S)
COMMANDS = re.compile(r"```bash\n(.*?)```", re.S)


def doc_section(page: str, title: str) -> str:
    """The section `title` of docs/`page`: its heading and what follows, up to the next heading of its level or above
    (a `# path` line in a code block is no heading)."""
    level, kept, fence = None, [], False
    for line in (PROJECT / "docs" / page).read_text().splitlines(keepends=True):
        if line.lstrip().startswith("```"):
            fence = not fence
        heading = None if fence else re.match(r"(#+) (.*)\n", line)
        if heading and level is not None and len(heading[1]) <= level:
            break
        if heading and level is None and heading[2] == title:
            level = len(heading[1])
        if level is not None:
            kept.append(line)
    assert level is not None, f"docs/{page} has no heading {title!r}"
    return "".join(kept)


def readme_example():
    """({path: text} of the section's files, [its commands]) as docs/your-own-task.md gives them."""
    section = doc_section("your-own-task.md", "Your own task")
    files = {path: f"# {path}\n{body}" for path, body in FILE_BLOCK.findall(section)}
    commands = [line.split("#")[0].strip() for block in COMMANDS.findall(section) for line in block.splitlines()]
    return files, [c for c in commands if c]


def project_copy(root: Path) -> Path:
    """The project's code, config and tests, without its outputs or data: what a user's checkout holds."""
    top = {"outputs", "data", "multirun"}

    def skip(folder, names):
        return [n for n in names if (Path(folder) == PROJECT and n in top) or n == "__pycache__" or n.startswith(".")]

    shutil.copytree(PROJECT, root, ignore=skip)
    return root


def run(copy: Path, command: str, *extra: str, expect: int = 0) -> subprocess.CompletedProcess:
    argv = shlex.split(command)
    assert argv[0] == "python", command
    proc = subprocess.run([sys.executable, *argv[1:], *extra], cwd=copy, capture_output=True, text=True, timeout=300)
    assert proc.returncode == expect, f"{command} {' '.join(extra)}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    """A project copy holding the page's files, and the page's commands."""
    files, commands = readme_example()
    assert sorted(files) == [
        "conf/data/houses.yaml",
        "conf/model/mlp.yaml",
        "conf/task/regression.yaml",
        "regression.py",
    ]
    assert [c.split()[1] for c in commands] == ["train.py", "eval.py"]
    copy = project_copy(tmp_path_factory.mktemp("own-task") / "project")
    for path, text in files.items():
        (copy / path).write_text(text)
    return copy, commands


@pytest.fixture(scope="module")
def trained(example):
    """The page's train command as written (default run folder under outputs/), then its eval command."""
    copy, (train, evaluate) = example
    run(copy, train)
    (run_dir,) = [p.parent for p in (copy / "outputs").glob("*/*/metrics.jsonl")]
    proc = run(copy, evaluate)
    (eval_dir,) = [p.parent for p in (copy / "outputs").glob("*/*/eval.json")]
    return copy, train, run_dir, eval_dir, proc


def test_the_readme_example_trains_evaluates_and_keeps_the_best_by_its_own_metric(trained):
    copy, _, run_dir, eval_dir, proc = trained
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert len(records) == 8 and all({"val_mse", "val_mae", "train_loss"} <= r.keys() for r in records)
    assert "val_acc" not in records[0] and "val_loss" not in records[0]  # the classification names are not forced
    assert records[-1]["val_mse"] < 0.5 * records[0]["val_mse"]  # it learns
    # best.pth follows checkpoint.monitor=val_mse checkpoint.mode=min: the epoch of the lowest val_mse
    best = load_ckpt(run_dir / "checkpoints/best.pth")["metrics"]
    assert best["val_mse"] == min(r["val_mse"] for r in records) and best["epoch"] in [r["epoch"] for r in records]
    # eval.py reproduces the run's last validation exactly, under the task's own names
    result = json.loads((eval_dir / "eval.json").read_text())
    assert (result["val_mse"], result["val_mae"]) == (records[-1]["val_mse"], records[-1]["val_mae"])
    assert "val_mse" in proc.stdout and "val_acc" not in result


@pytest.mark.slow
def test_the_readme_example_resumes_exactly_with_another_worker_count(trained, tmp_path):
    copy, train, run_dir, _, _ = trained
    first, second = tmp_path / "first", tmp_path / "second"
    run(copy, train, "max_steps=37", f"hydra.run.dir={first}")  # mid-epoch (25 steps an epoch), mid log interval
    run(copy, train, f"resume={first}/checkpoints/last.pth", "loader.num_workers=1", f"hydra.run.dir={second}")
    assert same_weights(run_dir / "checkpoints/last.pth", second / "checkpoints/last.pth")
    # negative control: the same resume from the start of the stopped epoch, as a resume that keeps no loader
    # position would do, ends elsewhere
    ckpt = load_ckpt(first / "checkpoints/last.pth")
    assert ckpt["ranks"][0]["loader"]["position"] == 12
    ckpt["ranks"][0]["loader"]["position"] = 0
    torch.save(ckpt, tmp_path / "restarted-epoch.pth")
    third = tmp_path / "third"
    run(copy, train, f"resume={tmp_path / 'restarted-epoch.pth'}", "loader.num_workers=1", f"hydra.run.dir={third}")
    assert not same_weights(run_dir / "checkpoints/last.pth", third / "checkpoints/last.pth")


def refusal(copy: Path, *overrides: str) -> str:
    """train.py refusing the command: exit 2, one `error:` line, no run folder written."""
    run_dir = copy / "refused-run"
    proc = run(copy, "python train.py", *overrides, f"hydra.run.dir={run_dir}", expect=2)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert not run_dir.exists()
    return lines[0]


REGRESSION = ["data=houses", "model=mlp", "task=regression"]


def test_the_task_seam_refuses_in_one_line_before_the_run_folder(example):
    copy, _ = example
    line = refusal(copy, *REGRESSION)  # checkpoint.monitor is still the classification default, val_acc
    assert line == "error: checkpoint.monitor=val_acc is not reported by task regression.Regression: " + (
        "pick one of train_loss, val_mse, val_mae"
    )


@pytest.mark.slow  # two more refusals through train.py; test_config.py refuses a wrong argument in the fast tier
def test_a_wrong_argument_of_the_pages_model_or_data_is_refused_in_one_line(example):
    copy, _ = example
    regression = [*REGRESSION, "checkpoint.monitor=val_mse"]
    line = refusal(copy, *regression, "+model.hiden=3")
    assert "model: cannot build regression.MLP: TypeError: MLP.__init__() got an unexpected keyword" in line
    assert "argument 'hiden'" in line
    line = refusal(copy, *regression, "+data.train.jiter=0.1")
    assert "data.train: cannot build regression.Houses: TypeError:" in line and "argument 'jiter'" in line


def test_a_config_older_than_data_input_trains_as_it_did(trained):
    """The page's regression (dict batches {"features", "price"}, as before data.input existed) sets no data.input
    and nothing that works on the input: it trains (the page's own train command, `trained`). The control: with a
    data.normalize, the default data.input=0 names no part of those batches, refused in one line naming both keys."""
    copy, train, run_dir, _, _ = trained
    assert "input" not in OmegaConf.load(copy / "conf/data/houses.yaml")
    assert "data.input" not in train and "data=houses" in train
    saved = load_ckpt(run_dir / "checkpoints/last.pth")
    assert "input" not in saved["config"]["data"] and saved["step"] > 0  # trained without the key
    normalize = "+data.normalize._target_={{ cookiecutter.package }}.engine.device.Normalize"
    assert refusal(copy, *shlex.split(train)[2:], normalize) == (
        "error: data.input=0 is not in the batch (a dict with keys features, price): set data.input to the position "
        "or key of the model's input, the part data.normalize works on"
    )


NO_COUNT = """
import torch.nn.functional as F


class NoCount:
    def loss(self, model, batch):
        return F.cross_entropy(model(batch[0]), batch[1])

    def metrics(self, model, batch):
        return {"loss": F.cross_entropy(model(batch[0]), batch[1], reduction="sum")}
"""

PUT_MODEL = """
import torch
from torch import nn


class PutModel(nn.Module):
    \"\"\"A linear head whose forward uses Tensor.put_, which has no deterministic kernel (on the CPU either).\"\"\"

    def __init__(self, num_classes: int = 4):
        super().__init__()
        self.head = nn.Linear(3, num_classes)

    def forward(self, x):
        pooled = x.mean(dim=(2, 3))
        pooled.put_(torch.tensor([0]), torch.tensor([0.0]))
        return self.head(pooled)
"""


@pytest.mark.slow
def test_a_task_without_count_and_an_op_without_a_deterministic_kernel_are_refused(example):
    copy, _ = example
    (copy / "no_count.py").write_text(NO_COUNT)
    (copy / "put_model.py").write_text(PUT_MODEL)
    line = refusal(copy, *RNG_DATA, "task._target_=no_count.NoCount", "~task.label_smoothing")
    assert "task no_count.NoCount: metrics() returned loss but no 'count' entry" in line
    line = refusal(copy, *RNG_DATA, "model=resnet18", "model._target_=put_model.PutModel")
    assert line == (
        "error: deterministic=true but put_ (in put_model.PutModel on cpu) has no deterministic kernel: "
        "use another op, or set deterministic=warn to run it anyway (the run is then not bit-exact, and says so)"
    )
    # deterministic=warn runs it: named once in the log, and the closing line and the checkpoint say so
    put = [*RNG_DATA, "model=resnet18", "model._target_=put_model.PutModel", "max_steps=2"]
    run(copy, "python train.py", *put, "deterministic=warn", f"hydra.run.dir={copy / 'warn'}")
    log = (copy / "warn/train.log").read_text()
    assert log.count("deterministic=warn: put_ ran without a deterministic kernel: this run is not bit-exact") == 1
    assert "; not bit-exact (put_: no deterministic kernel); to continue:" in log
    assert load_ckpt(copy / "warn/checkpoints/last.pth")["nondeterministic_ops"] == ["put_"]
    # negative controls: with deterministic=false nothing is checked, and a bit-exact run's checkpoint lists no op
    run(copy, "python train.py", *put, "deterministic=false", f"hydra.run.dir={copy / 'nondeterministic'}")
    assert load_ckpt(copy / "nondeterministic/checkpoints/last.pth")["nondeterministic_ops"] == []
    assert "not bit-exact" not in (copy / "nondeterministic/train.log").read_text()


@pytest.mark.slow
def test_data_collate_serves_both_loaders(example, tmp_path):
    """A collate of your own builds the batches of training and validation (the task reads its dicts)."""
    copy, _ = example
    collate = ["+data.collate._target_=tests.datasets.dict_collate", "+data.collate._partial_=true"]
    task = ["task._target_=tests.datasets.DictClassification", "~task.label_smoothing", "checkpoint.monitor=val_acc"]
    dicts = [*collate, "data.input=image"]  # the model's input: the dict's "image", the part data.normalize takes
    run(copy, "python train.py", *RNG_DATA, *dicts, *task, "epochs=1", f"hydra.run.dir={tmp_path / 'dicts'}")
    (record,) = read_jsonl(tmp_path / "dicts/metrics.jsonl")
    assert 0 <= record["val_acc"] <= 1 and "val_loss" not in record
    # negative control: without the collate the batches are tuples, which the dict task cannot read: an error in
    # the task's code, its traceback first (the line of loss() that reads the dict), then the line, exit 1
    proc = run(copy, "python train.py", *RNG_DATA, *task, f"hydra.run.dir={tmp_path / 'refused'}", expect=1)
    *trace, line = proc.stderr.strip().splitlines()
    assert line.startswith("error: task tests.datasets.DictClassification: loss() fails"), proc.stderr
    assert 'batch["image"]' in "\n".join(trace) and not (tmp_path / "refused").exists()


def test_the_shipped_models_pool_without_adaptive_avg_pool(example):
    """AdaptiveAvgPool2d's CUDA backward has no deterministic kernel (pytorch/pytorch#149130)."""
    from {{ cookiecutter.package }}.model import SmallCNN, resnet18

    for model in (SmallCNN(num_classes=3), resnet18(num_classes=3)):
        assert not [m for m in model.modules() if isinstance(m, torch.nn.AdaptiveAvgPool2d)]
        assert model(torch.randn(2, 3, 32, 32)).shape == (2, 3)


# The imports a run ended with, printed as the process exits (after train.py's own sys.exit, if any).
LOADED = (
    "import atexit, runpy, sys; sys.argv = ['train.py', *sys.argv[1:]]; "
    "atexit.register(lambda: print('torchvision' in sys.modules)); runpy.run_path('train.py', run_name='__main__')"
)


@pytest.mark.slow
def test_a_task_without_images_imports_no_torchvision(example, tmp_path):
    """The page's regression example (its own data, model and task) trains without torchvision being imported at
    all; the control: the default image classifier does import it, so the probe can see it."""
    copy, (train, _) = example
    images = f"python train.py data.root={tmp_path / 'shapes'} data.per_class=8 loader.batch_size=8"
    for name, command in (("regression", train), ("images", images)):
        argv = [*shlex.split(command)[2:], "max_steps=2", f"hydra.run.dir={tmp_path / name}"]
        proc = subprocess.run([sys.executable, "-c", LOADED, *argv], cwd=copy, capture_output=True, text=True,
                              timeout=300)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.strip().splitlines()[-1] == ("False" if name == "regression" else "True"), name
