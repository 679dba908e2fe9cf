"""The example stream dataset: split between workers (and ranks) so no sample is lost or repeated."""

import pytest
from torch.utils.data import DataLoader

from {{ cookiecutter.package }}.stream import ShardedStream
from tests.datasets import CountingShard, counting_stream

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")  # 3-4 workers on a 2-CPU runner


def keys(dataset, workers):
    loader = DataLoader(dataset, batch_size=5, num_workers=workers)
    return [(int(s), int(i)) for shard, index, _ in loader for s, i in zip(shard, index, strict=True)]


@pytest.mark.parametrize("workers", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("shards", [7, 2], ids=["whole-shards", "records-strided"])
def test_every_sample_once(workers, shards):
    got = keys(counting_stream(num_shards=shards, per_shard=13), workers)
    assert sorted(got) == [(s, i) for s in range(shards) for i in range(13)]


def test_ranks_and_workers_split_together():
    got = []
    for rank in (0, 1):
        got += keys(ShardedStream(range(3), CountingShard(11), rank=rank, world_size=2), workers=2)
    assert sorted(got) == [(s, i) for s in range(3) for i in range(11)]


def test_without_the_split_workers_repeat_samples():
    """What the split prevents: a stream that ignores get_worker_info() yields everything once per worker."""

    class Unsplit(ShardedStream):
        def readers(self):
            return 0, 1

    got = keys(Unsplit(range(3), CountingShard(4)), workers=2)
    assert len(got) == 2 * 12
