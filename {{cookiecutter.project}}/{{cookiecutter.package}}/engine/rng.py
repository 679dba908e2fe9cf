"""Random number generator state: capture, apply, seed, and a checkpoint-safe form.

A *raw* state is what the libraries hand out, cheap to take and to send between processes:
`(torch CPU state as bytes, numpy's global state tuple, python random state tuple)`.
The *saved* form holds only tensors, ints, floats and None, so a checkpoint loads with
`torch.load(weights_only=True)`: numpy's MT19937 key becomes an int64 tensor and its position ints.
"""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch
from torch.utils.data import get_worker_info

RawState = tuple  # (bytes, numpy state tuple, python state tuple)


def capture() -> RawState:
    return (torch.get_rng_state().numpy().tobytes(), np.random.get_state(), random.getstate())


def apply(raw: RawState) -> None:
    torch_bytes, numpy_state, python_state = raw
    torch.set_rng_state(torch.frombuffer(bytearray(torch_bytes), dtype=torch.uint8))
    np.random.set_state(numpy_state)
    random.setstate(python_state)


@contextlib.contextmanager
def kept(keep: bool = True, cuda: bool = True):
    """Around code that draws from or seeds the global generators: python's, numpy's and torch's (CPU and, with
    `cuda` once CUDA is in use, every device's) are put back afterwards, when `keep`. torch's own fork_rng keeps its
    states: no tensor is read back to the host. The per-batch callers keep the CPU generators only."""
    if not keep:
        yield
        return
    python = random.getstate()
    numpy = np.random.get_state()
    devices = range(torch.cuda.device_count()) if cuda and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(python)
            np.random.set_state(numpy)


def seed_cpu(seed: int) -> None:
    """Seed python, numpy and torch's CPU generator (not CUDA's) with `seed`: the state `from_seed(seed)` describes.

    Seeding in place costs ~15 us against ~200 us for building and applying the states."""
    seed = int(seed)
    torch.default_generator.manual_seed(seed)
    np.random.seed([seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF])
    random.seed(seed)


VALIDATION = 2**32  # the "epoch" validation samples are seeded in (epoch_base): one no run trains


def epoch_base(seed: int, epoch: int) -> int:
    """What `index_seed` mixes each sample index with, for one (seed, epoch): worked out once per batch or epoch."""
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1, np.uint64)[0])


# splitmix64's constants: a cheap, well-mixed 64-bit hash of (epoch base, sample index)
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_MASK = (1 << 64) - 1


def index_seed(base: int, index: int) -> int:
    """One sample's 64-bit seed from `epoch_base(seed, epoch)`: a pure function of (seed, epoch, index), in which
    nothing about rank, worker or the sample's place in its batch enters, so a sample draws the same whichever
    process makes it. ~1 us: a SeedSequence per sample would cost ~12 us."""
    x = (base + int(index) * _GOLDEN) & _MASK
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK
    return x ^ (x >> 31)


def seed_sample(seed: int, pipelines: list = ()) -> None:
    """Seed python, numpy and torch's CPU generator for one sample (rng_mode=per_sample), through their public
    seeding calls (numpy takes one 32-bit word here: its two-word seeding runs a longer initialisation), and
    `pipelines` (`own_generators`)."""
    torch.default_generator.manual_seed(seed)
    np.random.seed(seed >> 32)
    random.seed(seed)
    seed_pipelines(pipelines, seed)


def own_generators(dataset) -> list:
    """The augmentation pipelines among `dataset`'s attributes (and the items of a list, tuple or dict there) that
    hold generators of their own and can be handed others: albumentations 2's Compose and transforms, through
    their public `set_random_state(numpy_generator, python_random)`."""
    try:
        values = vars(dataset).values()
    except TypeError:  # a data set without a __dict__ (__slots__)
        return []
    found = []
    for value in values:
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
        found += [item for item in items if callable(getattr(item, "set_random_state", None))]
    return found


def seed_pipelines(pipelines: list, seed: int) -> None:
    """Each pipeline of `own_generators` given fresh generators seeded with `seed` (one sample's)."""
    for pipeline in pipelines:
        pipeline.set_random_state(np.random.default_rng(seed), random.Random(seed))


UNTOUCHED = 0x5EED  # numpy's and python's seed while a batch is made without seeding them
# numpy's and python's first draws after that seed: a data set that drew from them leaves others
UNTOUCHED_DRAWS = (np.random.RandomState(UNTOUCHED).random_sample(), random.Random(UNTOUCHED).random())


class SampleSeeding:
    """rng_mode=per_sample's seeding of `dataset`'s samples in one process (docs/rng-mode.md has why and what it
    costs): before each sample (`sample`), torch's CPU generator is seeded, and numpy's and python's too once the
    data set is seen drawing from them. `batch(make)` makes a batch with those two seeded with UNTOUCHED instead; if
    their next draws are not UNTOUCHED's first, the data set drew from them, and the batch is made again with them
    seeded: its samples are those of all three seeded. Afterwards the generators stand where that leaves them, for a
    collate that draws, or in the main process (num_workers=0) as they were."""

    def __init__(self, dataset):
        self.dataset = dataset
        self.all = False  # numpy and python are seeded too
        self.last = 0  # the last sample's seed
        self.pipelines = own_generators(dataset)  # the data set's augmentation pipelines with generators of their own

    def sample(self, base: int, index: int):
        """Sample `index`, its generators seeded from `index_seed(base, index)`."""
        self.last = seed = index_seed(base, index)
        seed_pipelines(self.pipelines, seed)
        if self.all:
            seed_sample(seed)
        else:
            torch.default_generator.manual_seed(seed)
        return self.dataset[index]

    def batch(self, make):
        with kept(get_worker_info() is None, cuda=False):
            if not self.all:
                np.random.seed(UNTOUCHED)
                random.seed(UNTOUCHED)
                made = make()
                if (np.random.random_sample(), random.random()) == UNTOUCHED_DRAWS:
                    np.random.seed(self.last >> 32)
                    random.seed(self.last)
                    return made
                self.all = True
            return make()


def from_seed(seed: int) -> RawState:
    """The state that `seed_cpu(seed)` leaves, the globals put back afterwards."""
    with kept(cuda=False):
        seed_cpu(seed)
        return capture()


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and every CUDA device) in this process. Seed 0 is a seed like any other."""
    seed_cpu(seed)
    torch.cuda.manual_seed_all(seed)  # without CUDA silently ignored (torch's documented contract), else lazily applied


def derived(*key: int) -> int:
    """A 63-bit seed that is a pure function of the integers `key` (e.g. seed, rank, step): well mixed, so
    neighbouring keys give unrelated streams."""
    words = np.random.SeedSequence([int(k) for k in key]).generate_state(2, np.uint32)
    return (int(words[0]) << 31) ^ int(words[1])


NUMPY_KEYS = ("name", "key", "pos", "has_gauss", "cached_gaussian")  # numpy's legacy state tuple, in order


def to_saved(raw: RawState) -> dict:
    torch_bytes, numpy_state, (version, internal, gauss_next) = raw
    numpy = dict(zip(NUMPY_KEYS, numpy_state, strict=True))
    numpy["key"] = torch.from_numpy(numpy["key"].astype(np.int64))
    return {
        "torch": torch.frombuffer(bytearray(torch_bytes), dtype=torch.uint8).clone(),
        "numpy": numpy,
        "python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64), "gauss_next": gauss_next},
    }


def from_saved(saved: dict) -> RawState:
    numpy = {**saved["numpy"], "key": saved["numpy"]["key"].numpy().astype(np.uint32)}
    p = saved["python"]
    python_state = (p["version"], tuple(p["internal"].tolist()), p["gauss_next"])
    return (saved["torch"].numpy().tobytes(), tuple(numpy[k] for k in NUMPY_KEYS), python_state)


def capture_main() -> dict:
    """Everything the main process draws from: python, numpy, torch CPU and, once CUDA is in use, every device."""
    state = to_saved(capture())
    if torch.cuda.is_initialized():  # initialized implies available
        state["cuda"] = [s.clone() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_main(state: dict) -> None:
    apply(from_saved(state))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"][: torch.cuda.device_count()])
