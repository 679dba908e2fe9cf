"""StreamLoader alone, in this process: each record once per epoch over workers, and a checkpoint at any batch
that continues batch for batch with the same readers, or each remaining record once with others."""

import pytest
import torch

from {{ cookiecutter.package }}.engine import failures, shard_plan
from {{ cookiecutter.package }}.engine.errors import UserError
from {{ cookiecutter.package }}.engine.loader import TrainLoader, eval_loader
from {{ cookiecutter.package }}.engine.stream_loader import StreamLoader
from tests.datasets import CountingShards, IndexedSamples, SplitStream, StatefulStream
from tests.helpers import end_workers, loader_settings

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")  # 3 workers on a 2-CPU runner
SIZES = (37, 5, 60, 18, 41, 9, 26, 14)


def keys_of(loader, batches=None):
    out = []
    for n, (_, _, keys) in enumerate(loader):
        out.append(keys.tolist())
        if batches is not None and n + 1 == batches:
            break
    return out


def flat(batches):
    return sorted(k for batch in batches for k in batch)


ALL = sorted(s * 1000 + i for s, n in enumerate(SIZES) for i in range(n))


@pytest.mark.parametrize("workers", [0, 2, 3])
def test_each_record_once_per_epoch_and_epochs_differ(workers):
    loader = StreamLoader(CountingShards(SIZES), loader_settings(batch_size=8, workers=workers), seed=1)
    planned = loader.batches_per_epoch
    first, second = keys_of(loader), keys_of(loader)
    assert flat(first) == ALL and flat(second) == ALL
    assert first != second  # the shard order is drawn per epoch
    assert len(first) == planned


def _inputs(loader, batches=None):
    out = []
    for n, (x, _, keys) in enumerate(loader):
        out.append((x.clone(), keys.tolist()))
        if batches is not None and n + 1 == batches:
            break
    return out


@pytest.mark.parametrize("stop", [1, 6, 13])
def test_a_checkpoint_continues_batch_for_batch(stop):
    settings = loader_settings(batch_size=8, workers=2)
    straight = _inputs(StreamLoader(CountingShards(SIZES), settings, seed=5))
    first = StreamLoader(CountingShards(SIZES), settings, seed=5)
    head = _inputs(first, stop)
    state = first.state_dict()
    resumed = StreamLoader(CountingShards(SIZES), settings, seed=5)
    resumed.load_state_dict(state)
    tail = _inputs(resumed)
    assert len(head) + len(tail) == len(straight)
    for (x, k), (y, j) in zip(head + tail, straight, strict=True):
        assert k == j and torch.equal(x, y)
    # negative control: the consumed counts zeroed, the rest of the epoch repeats records
    state["consumed"] = torch.zeros_like(state["consumed"])
    control = StreamLoader(CountingShards(SIZES), settings, seed=5)
    control.load_state_dict(state)
    assert flat([k for _, k in head] + [k for _, k in _inputs(control)]) != ALL


def test_other_workers_read_the_remaining_records_once():
    first = StreamLoader(CountingShards(SIZES), loader_settings(batch_size=8, workers=2), seed=2)
    head = keys_of(first, 7)
    resumed = StreamLoader(CountingShards(SIZES), loader_settings(batch_size=8, workers=3), seed=2)
    resumed.load_state_dict(first.state_dict())
    assert flat(head + keys_of(resumed)) == ALL


def test_a_stateful_plain_stream_continues_exactly_and_a_stateless_one_is_refused():
    settings = loader_settings(batch_size=8, workers=2)
    straight = _inputs(StreamLoader(StatefulStream(), settings, seed=3))
    first = StreamLoader(StatefulStream(), settings, seed=3)
    head = _inputs(first, 5)
    resumed = StreamLoader(StatefulStream(), settings, seed=3)
    resumed.load_state_dict(first.state_dict())
    tail = _inputs(resumed)
    assert [k for _, k in head + tail] == [k for _, k in straight]
    assert all(torch.equal(x, y) for (x, _), (y, _) in zip(head + tail, straight, strict=True))
    stateless = StreamLoader(SplitStream(), settings, seed=3)
    _inputs(stateless, 5)
    with pytest.raises(UserError, match="stream_resume=restart_epoch"):
        StreamLoader(SplitStream(), settings, seed=3).load_state_dict(stateless.state_dict())
    restart = StreamLoader(SplitStream(), settings, seed=3, stream_resume="restart_epoch")
    restart.load_state_dict(stateless.state_dict())
    assert flat(k for _, k in _inputs(restart)) == list(range(150))


def test_validation_streams_split_over_ranks_and_workers():
    got = []
    for rank in (0, 1):
        loader = eval_loader(CountingShards(SIZES), loader_settings(batch_size=8, workers=2), rank, 2)
        got += [k for _, _, keys in loader for k in keys.tolist()]
    assert sorted(got) == ALL


def test_what_cannot_be_planned_or_restored_is_refused_in_one_line():
    settings = loader_settings(batch_size=8, workers=2)
    with pytest.raises(UserError, match="without sizes: under torchrun"):
        StreamLoader(CountingShards(SIZES, with_sizes=False), settings, seed=0, rank=0, world_size=2)
    with pytest.raises(UserError, match="of no shards: under torchrun"):
        StreamLoader(StatefulStream(), settings, seed=0, rank=1, world_size=2)
    with pytest.raises(UserError, match="use rng_mode=per_sample"):
        StreamLoader(CountingShards(SIZES), settings, seed=0, rng_mode="per_worker")
    first = StreamLoader(StatefulStream(), settings, seed=0)
    keys_of(first, 3)
    other = StreamLoader(StatefulStream(), loader_settings(batch_size=8, workers=3), seed=0)
    with pytest.raises(UserError, match="resume with loader.num_workers=2"):
        other.load_state_dict(first.state_dict())
    indexed = TrainLoader(IndexedSamples(64), settings, seed=0).state_dict()
    with pytest.raises(UserError, match="resume with the data the run started with"):
        StreamLoader(StatefulStream(), settings, seed=0).load_state_dict(indexed)
    with pytest.raises(UserError, match="resume with the data the run started with"):
        TrainLoader(IndexedSamples(64), settings, seed=0).load_state_dict(first.state_dict())


def test_errors_in_a_worker_come_back_in_their_own_type_with_their_line():
    """PyTorch raises a worker's error again in its type (so its exit code), its message the worker's traceback."""
    settings = loader_settings(batch_size=8, workers=2)
    loader = StreamLoader(CountingShards(SIZES, refused={2010}), settings, seed=0)
    with pytest.raises(UserError) as refused:
        keys_of(loader)
    end_workers(loader)
    assert "shard 2 changed on disk since its sizes were counted: count them again" in str(refused.value)
    loader = StreamLoader(CountingShards(SIZES, bad={2010}), settings, seed=0)
    with pytest.raises(failures.BadSample) as bad:
        keys_of(loader)
    end_workers(loader)
    assert "shard 2 (2) record 10: ValueError: record 2010 is corrupt" in str(bad.value)


class NotATorchDataset:
    """A shard stream of no torch class: `shards`, `read` and `sizes` are all it takes."""

    def __init__(self):
        self.inner = CountingShards(SIZES)
        self.shards, self.sizes = self.inner.shards, self.inner.sizes

    def read(self, shard):
        return self.inner.read(shard)


def test_any_class_with_shards_and_read_is_a_shard_stream_and_an_indexed_one_is_not():
    assert shard_plan.is_stream(NotATorchDataset()) and shard_plan.is_stream(SplitStream())
    assert not shard_plan.is_stream(IndexedSamples(8))
    loader = StreamLoader(NotATorchDataset(), loader_settings(batch_size=8, workers=2), seed=0)
    assert flat(keys_of(loader)) == ALL


def test_a_rank_that_skipped_its_way_short_of_the_planned_steps_stops_in_one_line():
    """Two ranks, one reader each, batches of 4: shards of 9 and 20 records plan 3 steps for both. A bad record in
    the 9 leaves its rank 8 records, 2 batches: it stops there in one line instead of leaving the other waiting."""
    sizes = (9, 20)
    settings = loader_settings(batch_size=4, workers=0)
    plan = shard_plan.reader_shards(0, 0, list(sizes), 2, 2)
    short = next(rank for rank, shards in enumerate(plan) if shards == [0])
    loaders = [
        StreamLoader(CountingShards(sizes, bad={3}), settings, seed=0, rank=r, world_size=2, on_bad_sample="skip")
        for r in range(2)
    ]
    assert [loader.batches_per_epoch for loader in loaders] == [3, 3]
    assert len(keys_of(loaders[1 - short])) == 3  # the control: the other rank takes its 3 steps
    fewer = rf"left rank {short} short of epoch 0's 3 steps, which every process takes \(1 batch fewer\)"
    with pytest.raises(failures.BadSample, match=fewer):
        keys_of(loaders[short])


@pytest.mark.parametrize("claimed, held", [((37, 6), "5"), ((37, 4), "more")], ids=["fewer", "more"])
def test_a_shard_that_is_not_the_size_it_says_is_refused(claimed, held):
    loader = StreamLoader(CountingShards((37, 5), claimed=claimed), loader_settings(batch_size=8), seed=0)
    with pytest.raises(UserError) as wrong:
        keys_of(loader)
    end_workers(loader)
    says = f"CountingShards.sizes says shard 1 (1) holds {claimed[1]} records, but it holds {held}"
    assert f"{says}: give sizes that match the shards" in str(wrong.value)  # from a worker: with its traceback
