"""A truncated image in a real image folder: `data.on_bad_sample=error` stops in one line naming the file (exit 3,
the last step saved); `skip` drops it, lists it in bad_samples.txt, and stays exact across a stop and a resume."""

import re
from pathlib import Path

import pytest
import torch
from torchvision.transforms import v2

from {{ cookiecutter.package }}.data import ImageFiles, make_shapes
from {{ cookiecutter.package }}.engine import failures
from {{ cookiecutter.package }}.engine.loader import TrainLoader
from tests.helpers import end_workers, load_ckpt, loader_settings, read_jsonl, run_train, same_weights


def image_folder(root: Path, truncate: bool = True) -> Path:
    """80 train and 16 val shape PNGs (train/ and val/, a folder per class), one train image cut in half."""
    make_shapes(root, per_class=20, image_size=32, data_seed=7)
    bad = sorted((root / "train" / "circle").glob("*.png"))[3]
    if truncate:
        bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    return bad


def test_train_loader_names_the_bad_file_or_skips_it(tmp_path):
    bad = image_folder(tmp_path / "images")
    dataset = ImageFiles(tmp_path / "images" / "train", transform=v2.Compose([v2.ToImage()]))
    index = list(dataset.paths).index(str(bad))
    settings = loader_settings(16, workers=1)

    loader = TrainLoader(dataset, settings, seed=0)  # error: the batch holding it stops the loop, in one line
    with pytest.raises(failures.BadSample) as caught:
        for _ in loader:
            pass
    end_workers(loader)
    # PyTorch rebuilds the worker's BadSample in its type, its message the worker's traceback ending in our line
    line = f"data set index {index} (file {bad}): OSError: image file is truncated"
    assert line in str(caught.value) and caught.value.exit_code == failures.EXIT_BAD_SAMPLE == 3

    log = failures.BadSampleLog(tmp_path / "bad_samples.txt")
    loader = TrainLoader(dataset, settings, seed=0, on_bad_sample="skip", bad_samples=log)
    sizes = [len(labels) for _, labels in loader]
    assert sorted(sizes)[0] == 15 and sizes.count(16) == len(sizes) - 1 and loader.skipped == 1
    assert (tmp_path / "bad_samples.txt").read_text() == f"0\t0\t{line}\n"
    log.add(0, [line])  # the same sample consumed again (after a resume): listed once
    assert len((tmp_path / "bad_samples.txt").read_text().splitlines()) == 1
    end_workers(loader)


def test_a_batch_with_no_good_sample_is_refused_even_with_skip():
    class Broken(torch.utils.data.Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, index):
            raise ValueError("transform bug")

    with pytest.raises(failures.BadSample, match="every sample of a batch failed, e.g. data set index"):
        next(iter(TrainLoader(Broken(), loader_settings(16, workers=0), seed=0, on_bad_sample="skip")))


@pytest.mark.slow
def test_error_names_the_file_then_skip_resumes_it_exactly(tmp_path):
    bad = image_folder(tmp_path / "images")
    data = ["data=imagefolder", f"data.root={tmp_path / 'images'}", "data.num_classes=4", "data.image_size=32",
            "loader.batch_size=16", "epochs=2", "log_every_steps=1", "progress=false"]  # fmt: skip
    proc = run_train(tmp_path / "run", *data, expect=failures.EXIT_BAD_SAMPLE)
    # the worker's BadSample as PyTorch raises it again: its traceback, ending in the sample's line and the save
    assert proc.stderr.startswith("error: "), proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert re.search(rf"data set index \d+ \(file {re.escape(str(bad))}\): OSError: image file is truncated; ", last)
    stopped = load_ckpt(tmp_path / "run" / "checkpoints" / "last.pth")["step"]
    assert f"checkpoint of step {stopped} saved" in last and stopped < 10

    # the command the line suggests: skip it from here on, and go on from the checkpoint
    skip = [*data, "data.on_bad_sample=skip"]
    run_train(tmp_path / "run", *skip, "resume=latest", f"checkpoint.search_dir={tmp_path / 'run'}")
    run_train(tmp_path / "straight", *skip)
    records = read_jsonl(tmp_path / "straight" / "metrics.jsonl")
    assert [r["bad_samples"] for r in records] == [1, 1]  # the file is met once an epoch
    listed = (tmp_path / "straight" / failures.BAD_SAMPLES).read_text().splitlines()
    assert [line.split("\t")[0] for line in listed] == ["0", "1"] and all(str(bad) in line for line in listed)
    assert read_jsonl(tmp_path / "run" / "metrics.jsonl")[-1]["bad_samples"] == 1
    run, straight = tmp_path / "run" / "checkpoints" / "last.pth", tmp_path / "straight" / "checkpoints" / "last.pth"
    assert load_ckpt(run)["step"] == load_ckpt(straight)["step"] == 10 and same_weights(run, straight)

    # negative control: with the file whole, the sample is trained on, and the weights differ
    image_folder(tmp_path / "whole", truncate=False)
    whole = [o.replace(str(tmp_path / "images"), str(tmp_path / "whole")) for o in skip]
    run_train(tmp_path / "whole-run", *whole)
    assert not same_weights(tmp_path / "whole-run" / "checkpoints" / "last.pth", straight)
    assert not (tmp_path / "whole-run" / failures.BAD_SAMPLES).exists()
