"""stream.py's ShardStream under a DataLoader of your own, and JsonLines, the worked example."""

import json

import pytest
from torch.utils.data import DataLoader

from {{ cookiecutter.package }}.engine.errors import UserError
from {{ cookiecutter.package }}.stream import JsonLines
from tests.datasets import CountingShards

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")  # 3-4 workers on a 2-CPU runner


@pytest.mark.parametrize("workers", [0, 1, 3])
def test_a_plain_dataloader_gets_each_record_once(workers):
    loader = DataLoader(CountingShards((5, 9, 3, 7)), batch_size=4, num_workers=workers)
    got = sorted(k for _, _, keys in loader for k in keys.tolist())
    assert got == sorted(s * 1000 + i for s, n in enumerate((5, 9, 3, 7)) for i in range(n))


def test_read_starts_inside_a_shard_without_decoding_what_it_passes_over():
    stream = CountingShards((5,), bad={1})  # record 1 raises when decoded
    assert [key for _, _, key in stream.read(0, start=2)] == [2, 3, 4]
    with pytest.raises(ValueError):
        list(stream.read(0))  # the control: decoded from the start, record 1 fails


def write_jsonl(folder, counts, dim=3):
    folder.mkdir(parents=True, exist_ok=True)
    for f, count in enumerate(counts):
        records = [{"x": [float(f), float(i)] + [0.5] * (dim - 2), "label": (f + i) % 2} for i in range(count)]
        lines = [json.dumps(record) for record in records]
        (folder / f"part-{f}.jsonl").write_text("\n".join(lines) + "\n\n")  # a trailing blank line is no record
    return folder


def test_jsonlines_counts_its_records_and_reads_samples(tmp_path):
    stream = JsonLines(str(write_jsonl(tmp_path / "d", [4, 2]) / "*.jsonl"))
    assert stream.sizes == [4, 2]
    x, label = next(stream.read(stream.shards[1], start=1))
    assert x.tolist() == [1.0, 1.0, 0.5] and label == 0
    with pytest.raises(UserError, match="no files match"):
        JsonLines(str(tmp_path / "none" / "*.jsonl"))
