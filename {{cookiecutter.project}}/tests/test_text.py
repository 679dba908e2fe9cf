"""The text example of docs/your-own-task.md (token ids, a padding data.collate, a mask in a dict batch, a small
model), copied out of that page into a copy of the project and run as it says: it learns, eval.py repeats its last
validation, and a stop resumes exactly with another worker count."""

import json

import pytest

from tests.helpers import read_jsonl, same_weights
from tests.test_task import COMMANDS, FILE_BLOCK, doc_section, project_copy, run

SECTION = "Text: token ids, padding and an attention mask"


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    copy = project_copy(tmp_path_factory.mktemp("text") / "project")
    section = doc_section("your-own-task.md", SECTION)
    for path, body in FILE_BLOCK.findall(section):
        (copy / path).write_text(f"# {path}\n{body}")
    commands = [line.split("#")[0].strip() for block in COMMANDS.findall(section) for line in block.splitlines()]
    return copy, [c for c in commands if c]


@pytest.mark.slow
def test_the_text_example_learns_evaluates_and_resumes_exactly(example):
    copy, commands = example
    train, evaluate = commands
    assert train.startswith("python train.py data=reviews") and evaluate.startswith("python eval.py ckpt=latest")
    quick = ["progress=false", "epochs=2"]
    run(copy, train, *quick, f"hydra.run.dir={copy / 'outputs/straight'}")
    records = read_jsonl(copy / "outputs/straight/metrics.jsonl")
    assert records[-1]["val_acc"] > 0.75, records  # chance is about 0.5
    run(copy, evaluate, f"hydra.run.dir={copy / 'eval'}")  # ckpt=latest: the straight run's, the newest
    result = json.loads((copy / "eval/eval.json").read_text())
    assert (result["val_loss"], result["val_acc"]) == (records[-1]["val_loss"], records[-1]["val_acc"])
    assert result["val_loss"] != records[0]["val_loss"]  # control: the epochs' figures differ
    # stopped mid-epoch 1, resumed with another worker count
    first = copy / "outputs/first"
    steps = read_jsonl(copy / "outputs/straight/steps.jsonl")[-1]["step"]
    run(copy, train, *quick, f"max_steps={steps // 2 + 3}", f"hydra.run.dir={first}")
    resumed = [*quick, "loader.num_workers=1", f"resume={first}/checkpoints/last.pth"]
    run(copy, train, *resumed, f"hydra.run.dir={copy / 'outputs/second'}")
    straight = copy / "outputs/straight/checkpoints/last.pth"
    assert same_weights(straight, copy / "outputs/second/checkpoints/last.pth")
    # negative control: the same resume without the dropped tokens (resume_strict=false) ends elsewhere
    run(copy, train, *resumed, "data.train.drop=0.0", "resume_strict=false", f"hydra.run.dir={copy / 'outputs/nodrop'}")
    assert not same_weights(straight, copy / "outputs/nodrop/checkpoints/last.pth")
