"""The train loader's pieces, with real worker processes: batch order, worker seeding and RNG snapshots."""

import contextlib
import pickle
import signal
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch

from {{ cookiecutter.package }}.engine import rng
from {{ cookiecutter.package }}.engine.loader import (
    INLINE_BYTES,
    EpochBatchSampler,
    GuardedDataLoader,
    InlineTensor,
    TrainLoader,
    eval_loader,
    for_the_queue,
)
from {{ cookiecutter.package }}.engine.preempt import StopRequest
{% if cookiecutter.with_streams == "yes" %}
from {{ cookiecutter.package }}.engine.stream_loader import StreamLoader
{% endif %}
from tests.datasets import (
    Detections,
    IndexedDraws,
    IndexedSamples,
    RngDrawingDataset,
    SometimesDraws,
{% if cookiecutter.with_streams == "yes" %}
    SplitStream,
{% endif %}
    collate_with_numpy_draw,
    reference_collate,
)
from tests.helpers import loader_settings


def test_sampler_is_a_permutation_per_epoch_and_skips_without_loading():
    sampler = EpochBatchSampler(50, 8, seed=3)  # 6 whole batches: 2 samples left out, other ones each epoch
    first = [i for batch in sampler for i in batch]
    assert len(set(first)) == 48 and set(first) <= set(range(50))
    sampler.set_epoch(1)
    assert [i for batch in sampler for i in batch] != first
    sampler.set_epoch(0, start=2)
    assert [i for batch in sampler for i in batch] == first[16:] and len(sampler) == 4


def test_sampler_shards_ranks_disjointly():
    shards = [set(i for b in EpochBatchSampler(64, 4, seed=0, rank=r, world_size=2) for i in b) for r in (0, 1)]
    assert not shards[0] & shards[1] and len(shards[0] | shards[1]) == 64


def epoch_batches(loader):
    return [x.clone() for x, _ in loader]


@pytest.mark.parametrize("workers", [0, 2])
def test_the_loader_counts_the_samples_of_every_batch_form(workers):
    """`drawn`: the samples collated into the batch the loop took last, not a size read off the batch: torchvision's
    detection collate (a tuple of image tuples: the first image's leading size is its 3 channels), dicts, a stream's
    records. 70 samples in batches of 8: 8 whole batches (an epoch drops the short one); a stream's readers keep
    theirs."""
    forms = {
        "tuples": (Detections(70), reference_collate),
        "dicts": (Detections(70), lambda b: {"images": [s[0] for s in b], "labels": [s[1] for s in b]}),
        "tensors": (RngDrawingDataset(70), None),
    }
    for name, (dataset, collate) in forms.items():
        loader = TrainLoader(dataset, loader_settings(8, workers), seed=1, collate_fn=collate)
        counts = [loader.drawn for _ in loader]
        assert counts == [8] * 8, (name, counts)
{% if cookiecutter.with_streams == "yes" %}
    stream = StreamLoader(SplitStream(70), loader_settings(8, workers), seed=1, collate_fn=reference_collate)
    counts = [stream.drawn for _ in stream]
    assert sum(counts) == 70 and max(counts) == 8, counts  # each reader batches its own records: short ends
{% endif %}


def validation_samples(batch_size: int, workers: int, world_size: int, seed: int | None) -> dict:
    """Index -> input of every validation sample of IndexedSamples (which draw from torch, numpy and python), read
    twice per rank, as two validations would."""
    samples = {}
    for rank in range(world_size):
        loader = eval_loader(IndexedSamples(30), loader_settings(batch_size, workers), rank, world_size, seed=seed)
        for _ in range(2):
            for x, _, index in loader:
                for row, i in zip(x, index.tolist(), strict=True):
                    assert i not in samples or torch.equal(samples[i], row) == (seed is not None), i
                    samples[i] = row
    return samples


def test_validation_samples_draw_the_same_for_any_profile_under_per_sample():
    """rng_mode=per_sample (a seed): each validation sample seeded from it and its index, the same at every
    validation and for any batch size, worker count or number of ranks; the main process's RNG left as it was.
    Control: without a seed (per_worker) the draws follow the workers, and differ."""
    before = pickle.dumps(rng.capture())
    reference = validation_samples(4, 0, 1, seed=3)
    assert pickle.dumps(rng.capture()) == before  # num_workers=0: the main process's generators put back
    for batch_size, workers, world_size in [(8, 2, 1), (3, 3, 2)]:
        other = validation_samples(batch_size, workers, world_size, seed=3)
        assert other.keys() == reference.keys() and all(torch.equal(other[i], reference[i]) for i in reference)
    unseeded = [validation_samples(4, w, 1, seed=None) for w in (1, 2)]
    assert not all(torch.equal(unseeded[0][i], unseeded[1][i]) for i in reference)


def test_workers_seeded_from_seed_and_distinct():
    loader = TrainLoader(RngDrawingDataset(64), loader_settings(8, 2), seed=5, rng_mode="per_worker")
    a = epoch_batches(loader)
    b = epoch_batches(TrainLoader(RngDrawingDataset(64), loader_settings(8, 2), seed=5, rng_mode="per_worker"))
    c = epoch_batches(TrainLoader(RngDrawingDataset(64), loader_settings(8, 2), seed=6, rng_mode="per_worker"))
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not torch.equal(a[0], c[0])
    assert len(loader.worker_pids) == 2


def test_persistent_workers_live_across_epochs_and_streams_run_on():
    loader = TrainLoader(RngDrawingDataset(64), loader_settings(8, 2), seed=5)
    first = epoch_batches(loader)
    pids = set(loader.worker_pids)
    second = epoch_batches(loader)
    assert loader.worker_pids == pids and loader.epoch == 2
    assert not torch.equal(first[0], second[0])


def test_per_sample_batches_do_not_depend_on_workers():
    runs = [epoch_batches(TrainLoader(RngDrawingDataset(48), loader_settings(8, w), seed=2)) for w in (0, 1, 3)]
    assert all(torch.equal(x, y) for other in runs[1:] for x, y in zip(runs[0], other, strict=True))
    main_before = torch.get_rng_state()
    epoch_batches(TrainLoader(RngDrawingDataset(48), loader_settings(8, 0), seed=2))
    assert torch.equal(main_before, torch.get_rng_state())  # data randomness leaves the main RNG alone


def draws_by_sample(batch_size: int, workers: int, world_size: int, rng_mode: str = "per_sample") -> dict:
    """sample index -> what it drew in epoch 1 (the second), over every rank of a `world_size`-process layout."""
    out = {}
    for rank in range(world_size):
        loader = TrainLoader(
            IndexedDraws(48), loader_settings(batch_size, workers), 2, rng_mode, rank=rank, world_size=world_size
        )
        for _ in range(2):
            epoch = [(i, d) for indices, draws in loader for i, d in zip(indices.tolist(), draws, strict=True)]
        out.update(epoch)
    return out


def test_per_sample_draws_do_not_depend_on_rank_batch_or_worker():
    """A sample's draws are keyed on (seed, epoch, index): the same whichever rank, worker or batch position makes
    it. The control, per_worker streams, gives other draws for another layout."""
    one = draws_by_sample(8, 2, 1)
    assert len(one) == 48
    for batch_size, workers, world_size in ((4, 3, 2), (4, 0, 3), (16, 1, 1)):
        other = draws_by_sample(batch_size, workers, world_size)
        assert other.keys() == one.keys() and all(torch.equal(one[i], other[i]) for i in one), world_size
    worker = draws_by_sample(8, 2, 1, "per_worker"), draws_by_sample(4, 2, 2, "per_worker")
    assert sum(torch.equal(worker[0][i], worker[1][i]) for i in worker[0]) < 4


def test_state_dict_mid_epoch_resumes_exactly():
    """rng_mode=per_worker: the workers' own streams are saved and restored."""
    for workers, persistent in ((0, False), (2, True), (3, False), (3, True)):
        rng.seed_everything(9)  # with 0 workers the dataset draws from the main RNG
        settings = loader_settings(8, workers, persistent)
        straight = TrainLoader(RngDrawingDataset(80), settings, seed=1, rng_mode="per_worker")
        expected = epoch_batches(straight) + epoch_batches(straight)
        rng.seed_everything(9)
        first = TrainLoader(RngDrawingDataset(80), settings, seed=1, rng_mode="per_worker")
        got = epoch_batches(first)
        for i, (x, _) in enumerate(first):
            got.append(x.clone())
            if i == 3:
                break
        state, main_rng = first.state_dict(), rng.capture_main()
        resumed = TrainLoader(RngDrawingDataset(80), settings, seed=1, rng_mode="per_worker")
        resumed.load_state_dict(state)
        rng.restore_main(main_rng)
        got += epoch_batches(resumed)
        assert len(got) == len(expected)
        assert all(torch.equal(x, y) for x, y in zip(got, expected, strict=True)), (workers, persistent)


def test_loop_that_breaks_and_goes_on_in_the_same_process_stays_exact():
    """Persistent workers prefetch past a break (here 6 of 30 batches): the rest of the epoch and the next one must
    start from the streams as consumed, not from the workers' RNG, which ran ahead."""
    settings = loader_settings(8, 3, persistent=True)
    straight = TrainLoader(RngDrawingDataset(240), settings, seed=1, rng_mode="per_worker")
    expected = epoch_batches(straight) + epoch_batches(straight)
    loader = TrainLoader(RngDrawingDataset(240), settings, seed=1, rng_mode="per_worker")
    got = []
    for i, (x, _) in enumerate(loader):
        got.append(x.clone())
        if i == 4:
            break
    got += epoch_batches(loader) + epoch_batches(loader)
    assert len(got) == len(expected) and all(torch.equal(x, y) for x, y in zip(got, expected, strict=True))


def test_small_tensors_travel_by_value_and_arrive_as_they_left():
    """Labels and other small tensors skip the shared-memory file (a file, a mapping and an fd handover each);
    what arrives is the same tensor: values, dtype and shape. Larger ones still go through shared memory."""
    small = [torch.tensor(7), torch.arange(5), torch.ones(2, 3, dtype=torch.bfloat16), torch.tensor([True, False])]
    for t in small:
        back = pickle.loads(ForkingPickler.dumps(InlineTensor(t)))
        assert torch.equal(back, t) and back.dtype == t.dtype and back.shape == t.shape and not back.is_shared()
    assert all(isinstance(for_the_queue(t), InlineTensor) for t in small)
    assert not isinstance(for_the_queue(torch.zeros(INLINE_BYTES + 1, dtype=torch.uint8)), InlineTensor)
    loader = TrainLoader(RngDrawingDataset(32, image_size=64), loader_settings(8, 2), seed=1)
    for images, labels in loader:  # 8 x 3 x 64 x 64 floats: 384 KiB
        assert images.is_shared() and not labels.is_shared() and labels.dtype == torch.int64
        assert labels.shape == (8,) and 0 <= labels.min() and labels.max() < 4


def eager_reference(dataset, batches, seed: int, epoch: int) -> tuple[dict, list]:
    """What seeding torch, numpy and python before every sample gives: each sample's draws, and each batch's collate
    draw (numpy, after the batch's last sample)."""
    saved, by_sample, collated = rng.capture(), {}, []
    for batch in batches:
        for index in batch:
            rng.seed_sample(rng.index_seed(rng.epoch_base(seed, epoch), index))
            by_sample[index] = dataset[index][1]
        collated.append(float(np.random.uniform()))
    rng.apply(saved)
    return by_sample, collated


def seeded_run(workers: int, rng_mode: str = "per_sample", dataset=None) -> tuple[dict, list, list, TrainLoader]:
    loader = TrainLoader(
        dataset or SometimesDraws(48), loader_settings(8, workers), 4, rng_mode=rng_mode,
        collate_fn=collate_with_numpy_draw,
    )  # fmt: skip
    by_sample, collated, batches = {}, [], []
    for indices, draws, drawn in loader:
        by_sample.update(zip(indices.tolist(), draws))
        collated.append(float(drawn))
        batches.append(indices.tolist())
    return by_sample, collated, batches, loader


def test_every_sample_draws_from_generators_seeded_for_it():
    """rng_mode=per_sample: each sample draws what seeding torch, numpy and python `random` with its key gives
    (`seed_sample`), with workers and without (where the collate runs in the main process, on its RNG), and the
    collate after it too. It holds for a data set that draws from numpy and python now and then, for one that
    draws from numpy at one sample of the epoch's last batch only (its batch is made again, numpy seeded), and for
    one that draws from torch alone (numpy and python then go unseeded, seeded for the collate once a batch).
    The controls: per_worker streams give other numbers, and so does a data set that hides its numpy draws."""
    last = list(EpochBatchSampler(48, 8, seed=4))[-1][3]
    cases = {
        "now and then": lambda: SometimesDraws(48),
        "late numpy": lambda: SometimesDraws(48, numpy_at=[last], python_at=[]),
        "torch alone": lambda: SometimesDraws(48, numpy_at=[], python_at=[]),
    }
    for name, make in cases.items():
        for workers in (0, 2):
            by_sample, collated, batches, loader = seeded_run(workers, dataset=make())
            want, want_collated = eager_reference(make(), batches, seed=4, epoch=0)
            assert all(torch.equal(by_sample[i], want[i]) for i in want), (name, workers)
            assert collated == want_collated or workers == 0, name  # without workers the collate draws on the main RNG
            if workers == 0:  # numpy and python are seeded once the data set is seen drawing from them
                assert loader.dataset.seeding.all == (name != "torch alone"), name
    by_sample, collated, batches, _ = seeded_run(2, rng_mode="per_worker")
    want, want_collated = eager_reference(SometimesDraws(48), batches, seed=4, epoch=0)
    assert any(not torch.equal(by_sample[i], want[i]) for i in want) and collated != want_collated
    hidden = SometimesDraws(48, numpy_at=[last], python_at=[], restore=True)
    by_sample, _, batches, _ = seeded_run(0, dataset=hidden)
    want, _ = eager_reference(hidden, batches, seed=4, epoch=0)
    assert not torch.equal(by_sample[last], want[last])


sigterm_blocked_at_init = None  # set in the worker by record_mask


def record_mask(worker_id: int) -> None:
    """worker_init_fn: whether SIGTERM was blocked when the worker got here, where train.py's shield takes over."""
    global sigterm_blocked_at_init
    sigterm_blocked_at_init = signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, [])


class MaskAtInit(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> bool:
        return sigterm_blocked_at_init


def test_workers_start_with_sigterm_blocked_until_their_worker_init():
    """Between a worker's fork and its worker_init_fn, PyTorch's handler lets a SIGTERM from anyone but the parent kill
    it: StopRequest.starting_workers keeps it blocked there, and leaves this process's own mask as it was."""
    for guard, blocked in ((StopRequest.starting_workers, True), (contextlib.nullcontext, False)):  # and the control
        settings = loader_settings(workers=1, persistent=False)
        loader = GuardedDataLoader(MaskAtInit(), settings, guard, batch_size=None, worker_init_fn=record_mask)
        assert list(loader) == [blocked, blocked], guard
        assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
