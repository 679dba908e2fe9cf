{% if cookiecutter.with_streams == "yes" %}
"""eval.py: a checkpoint evaluated later gives exactly the numbers its run logged, on an indexed data set or a stream,
in one process or under torchrun; bad input gets one line."""
{% else %}
"""eval.py: a checkpoint evaluated later gives exactly the numbers its run logged; bad input gets one line."""
{% endif %}

import json
import subprocess
import sys
from pathlib import Path

import pytest

{% if cookiecutter.with_streams == "yes" %}
from tests.helpers import NOT_A_PICKLE, PROJECT, load_ckpt, read_jsonl, run_torchrun, run_train, torchrun_cmd
from tests.test_stream import write_jsonl
{% else %}
from tests.helpers import NOT_A_PICKLE, PROJECT, load_ckpt, read_jsonl, torchrun_cmd
{% endif %}


@pytest.fixture(scope="module")
def trained(shapes_run) -> Path:
    """Two epochs on image files with augmentation; checkpoints after each epoch (step 5 and step 10): the session's
    shared run (conftest.py), the only run in its parent folder."""
    return shapes_run


def run_eval(run_dir: Path, *overrides: str, expect: int = 0, nproc: int = 1) -> subprocess.CompletedProcess:
    """`python eval.py ...`, or `nproc` processes of it under torchrun; asserts the exit code."""
    cmd = [sys.executable, "eval.py", *overrides, f"hydra.run.dir={run_dir}"]
    if nproc > 1:
        cmd = torchrun_cmd(run_dir, *overrides, nproc=nproc, script="eval.py")
    proc = subprocess.run(cmd, cwd=PROJECT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == expect, f"exit {proc.returncode} != {expect}: {' '.join(cmd)}\n{proc.stderr[-3000:]}"
    return proc


def test_last_checkpoint_gives_the_runs_last_metrics_exactly(tmp_path, trained):
    records = read_jsonl(trained / "metrics.jsonl")
    # no data or loader overrides: eval.py takes them from the checkpoint, as the run trained
    proc = run_eval(tmp_path / "last", f"ckpt={trained}/checkpoints/last.pth")
    result = json.loads((tmp_path / "last/eval.json").read_text())
    assert (result["val_loss"], result["val_acc"]) == (records[-1]["val_loss"], records[-1]["val_acc"])
    assert result["step"] == records[-1]["step"] and result["checkpoint"] == f"{trained}/checkpoints/last.pth"
    printed = [line for line in proc.stdout.splitlines() if not line.startswith("[")]  # log records aside
    assert len(printed) == 1 and "val_acc" in printed[0]
    assert (result["count"], result["count_unit"], result["samples"]) == (32, "samples", 32)
    assert " on 32 samples -> " in printed[0]
    # negative control: the epoch-0 checkpoint gives epoch 0's numbers, which are not the last epoch's
    run_eval(tmp_path / "first", f"ckpt={trained}/checkpoints/step-00000005.pth")
    first = json.loads((tmp_path / "first/eval.json").read_text())
    assert (first["val_loss"], first["val_acc"]) == (records[0]["val_loss"], records[0]["val_acc"])
    assert first["val_loss"] != result["val_loss"]


def test_best_checkpoint_holds_the_best_epoch(tmp_path, trained):
    records = read_jsonl(trained / "metrics.jsonl")
    best = load_ckpt(trained / "checkpoints/best.pth")  # weights_only=True
    expected = next(r for r in records if r["val_acc"] == max(r["val_acc"] for r in records))  # the first of ties
    assert best["metrics"] == expected and best["step"] == expected["step"]
    assert best["best"] == {"monitor": "val_acc", "mode": "max", "value": expected["val_acc"]}
    assert load_ckpt(trained / "checkpoints/last.pth")["best"]["value"] == expected["val_acc"]
{% if cookiecutter.with_fsdp == "no" %}


def test_export_writes_the_models_weights_to_a_new_file_only(tmp_path, trained):
    """python -m <package>.export CKPT OUT: the model's weights alone, plain tensors; an OUT that exists stays."""
    out = tmp_path / "model.pth"
    cmd = [sys.executable, "-m", "{{ cookiecutter.package }}.export", f"{trained}/checkpoints/last.pth", str(out)]
    assert subprocess.run(cmd, cwd=PROJECT, capture_output=True, timeout=120).returncode == 0
    weights, last = load_ckpt(out), load_ckpt(trained / "checkpoints/last.pth")["model"]  # weights_only=True
    assert weights.keys() == {"model"} and weights["model"].keys() == last.keys()
    assert all(weights["model"][k].equal(last[k]) for k in last)
    again = subprocess.run(cmd, cwd=PROJECT, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and again.stderr.startswith(f"error: export: {out} exists")
{% endif %}


@pytest.mark.slow
def test_best_latest_and_another_split(tmp_path, trained):
    records = read_jsonl(trained / "metrics.jsonl")
    best = load_ckpt(trained / "checkpoints/best.pth")["metrics"]
    run_eval(tmp_path / "best", f"ckpt={trained}/checkpoints/best.pth")
    result = json.loads((tmp_path / "best/eval.json").read_text())
    assert (result["val_loss"], result["val_acc"], result["metrics"]) == (best["val_loss"], best["val_acc"], best)
    run_eval(tmp_path / "a", "ckpt=latest", f"checkpoint.search_dir={trained.parent}", "split=train")
    result = json.loads((tmp_path / "a/eval.json").read_text())
    assert result["split"] == "train" and result["samples"] == 160 and 0 <= result["train_acc"] <= 1
    assert result["step"] == records[-1]["step"]  # latest: the newest last.pth
    # a task that counts something else than samples (tokens, pixels) names it, in the line and in eval.json
    proc = run_eval(tmp_path / "tokens", f"ckpt={trained}/checkpoints/last.pth", "task._target_=tests.datasets.Tokens")
    result = json.loads((tmp_path / "tokens/eval.json").read_text())
    assert (result["count"], result["count_unit"]) == (32, "tokens") and "samples" not in result
    assert " on 32 tokens -> " in proc.stdout


@pytest.mark.slow
def test_a_corrupt_checkpoint_is_refused_in_one_line(tmp_path):
    (tmp_path / "random.pth").write_bytes(NOT_A_PICKLE)  # torch warns on these before it refuses them
    proc = run_eval(tmp_path / "run", f"ckpt={tmp_path / 'random.pth'}", expect=2)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: eval: "), proc.stderr
    assert "not a readable checkpoint" in lines[0], proc.stderr
    assert not (tmp_path / "run/eval.json").exists()


@pytest.mark.slow
def test_bad_input_is_refused_in_one_line(tmp_path, trained):
    cases = [
        ([f"ckpt={tmp_path / 'missing.pth'}"], "no checkpoint at"),
        ([], "give ckpt="),
        ([f"ckpt={trained}/checkpoints/last.pth", "split=test"], "split='test'"),
        ([f"ckpt={trained}/checkpoints/last.pth", "model=resnet18"], "do not fit"),
    ]
    for i, (overrides, message) in enumerate(cases):
        proc = run_eval(tmp_path / str(i), *overrides, expect=2)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr
        assert not (tmp_path / str(i) / "eval.json").exists()
{% if cookiecutter.with_streams == "yes" %}


VAL_FILES = [9, 5, 7, 4]  # records per val/*.jsonl file: readers take whole files and batch their own records


@pytest.fixture(scope="module")
def jsonl_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("jsonl")
    write_jsonl(root / "train", [30, 12, 21], dim=6)
    write_jsonl(root / "val", VAL_FILES, dim=6)
    return root


def jsonl_run(root: Path) -> list[str]:
    """train.py on data=jsonlines, a linear model of its 6 features; one worker, where eval.py's default is two."""
    return [
        "data=jsonlines",
        f"data.root={root}",
        "data.num_classes=2",
        "model._target_=tests.datasets.Linear",
        "~model.width",
        "+model.in_features=6",
        "epochs=2",
        "loader.batch_size=4",
        "loader.num_workers=1",
        "progress=false",
    ]


# data.val as a plain torch IterableDataset of the tests' own, splitting itself over workers and processes
PLAIN_VAL = [
    "data.val._target_=tests.datasets.FixedStream",
    *[f"~data.val.{key}" for key in ("files", "input_key", "label_key", "count")],
    "+data.val.size=50",
]


def figures(record: dict) -> dict:
    return {k: v for k, v in record.items() if k.startswith("val_")}


def evaluated(run_dir: Path, ckpt: Path, nproc: int = 1) -> dict:
    """eval.py's eval.json for `ckpt`, the data and loader left to the checkpoint; one line printed (rank 0's)."""
    proc = run_eval(run_dir, f"ckpt={ckpt}", nproc=nproc)
    printed = [line for line in proc.stdout.splitlines() if not line.startswith("[")]  # log records aside
    assert len(printed) == 1 and "val_acc" in printed[0], proc.stdout
    return json.loads((run_dir / "eval.json").read_text())


@pytest.mark.slow  # a run and two of eval.py; the fast tier: eval.py exact on a checkpoint (above), a stream through
# train.py (test_stream_train.py)
def test_a_json_lines_stream_gives_the_runs_last_figures_exactly(tmp_path, jsonl_root):
    run_train(tmp_path / "run", *jsonl_run(jsonl_root))
    records = read_jsonl(tmp_path / "run/metrics.jsonl")
    result = evaluated(tmp_path / "last", tmp_path / "run/checkpoints/last.pth")
    assert figures(result) == figures(records[-1]) and len(figures(result)) == 2
    assert result["samples"] == sum(VAL_FILES) and result["step"] == records[-1]["step"]  # each record once
    # negative control: epoch 0's checkpoint gives epoch 0's figures, which are not the last epoch's
    first = evaluated(tmp_path / "first", sorted((tmp_path / "run/checkpoints").glob("step-*.pth"))[0])
    assert first["step"] == records[0]["step"] and figures(first) == figures(records[0])
    assert first["val_loss"] != result["val_loss"]


@pytest.mark.slow  # a run and eval.py: the json lines test above with a stream class of one's own
def test_a_plain_stream_of_ones_own_gives_the_runs_last_figures_exactly(tmp_path, jsonl_root):
    run_train(tmp_path / "run", *jsonl_run(jsonl_root), *PLAIN_VAL)
    records = read_jsonl(tmp_path / "run/metrics.jsonl")
    result = evaluated(tmp_path / "last", tmp_path / "run/checkpoints/last.pth")
    assert figures(result) == figures(records[-1]) and result["samples"] == 50


@pytest.mark.slow
@pytest.mark.parametrize("val", [[], PLAIN_VAL], ids=["jsonlines", "plain-stream"])
def test_two_torchrun_processes_give_a_two_process_runs_last_figures_exactly(tmp_path, jsonl_root, val):
    """Each rank reads its share of the stream (whole files, or the records the stream hands that rank) and the
    sums are added over the ranks: the split once, batched as the run's validation batched it."""
    run_torchrun(tmp_path / "run", *jsonl_run(jsonl_root), *val)
    records = read_jsonl(tmp_path / "run/metrics.jsonl")
    size = 50 if val else sum(VAL_FILES)
    result = evaluated(tmp_path / "last", tmp_path / "run/checkpoints/last.pth", nproc=2)
    assert figures(result) == figures(records[-1]) and result["samples"] == size
    # one process reads every record once too (other batches: its figures need not match to the last digit)
    alone = evaluated(tmp_path / "alone", tmp_path / "run/checkpoints/last.pth")
    assert alone["samples"] == size and alone["val_acc"] == result["val_acc"]
{% endif %}
