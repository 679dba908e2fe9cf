"""Small datasets for the tests, plugged in through `data.train._target_` like a user's own."""

import json
import os
import random
import threading
import time

import numpy as np
import torch

try:  # the test extra's: the tests that use it skip without it
    import albumentations
except ImportError:
    albumentations = None
from torch.utils.data import Dataset{% if cookiecutter.with_streams == "yes" %}, IterableDataset{% endif +%}

{% if cookiecutter.with_streams == "yes" %}
from {{ cookiecutter.package }}.engine.errors import UserError
{% endif %}
{% if cookiecutter.with_shards == "yes" %}
from {{ cookiecutter.package }}.shards import ShardDataset
{% endif %}
{% if cookiecutter.with_streams == "yes" %}
from {{ cookiecutter.package }}.stream import ShardStream
{% endif %}
from {{ cookiecutter.package }}.tasks import Classification


class RngDrawingDataset(Dataset):
    """Each item draws from the worker's global torch, numpy and python RNGs, as user augmentations do.

    The label is learnable from the clean part of the input, so training moves the weights; the
    noise makes every weight depend on every draw, so any RNG slip changes the result.
    """

    def __init__(self, size: int = 256, num_classes: int = 4, image_size: int = 16, draws: bool = True):
        self.size, self.num_classes, self.image_size, self.draws = size, num_classes, image_size, draws

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        label = index % self.num_classes
        x = torch.full((3, self.image_size, self.image_size), float(label) / self.num_classes)
        if not self.draws:  # a fixed sample per index (validation data that does not change between runs)
            return x + 0.3 * torch.randn(x.shape, generator=torch.Generator().manual_seed(index)), label
        x = x + 0.3 * torch.randn_like(x) + float(np.random.uniform(-0.1, 0.1)) + random.gauss(0.0, 0.1)
        return x, label


class GrayImages(RngDrawingDataset):
    """RngDrawingDataset's samples as a grayscale data set ships them: uint8 images of one channel, `(1, H, W)`."""

    def __getitem__(self, index: int):
        image, label = super().__getitem__(index)
        return (image[:1].clamp(0, 1) * 255).round().to(torch.uint8), label


class IndexedSamples(RngDrawingDataset):
    """RngDrawingDataset's samples, each with its index: `(x, label, index)`, so a batch says which samples it holds
    (RecordingClassification writes them down). `draws=False`: fixed samples, drawn from the index alone."""

    def __init__(
        self, size: int = 96, num_classes: int = 4, image_size: int = 4, draws: bool = True, item_s: float = 0
    ):
        super().__init__(size, num_classes, image_size, draws)
        self.item_s = item_s  # seconds each item takes, like slow storage: a run long enough to stop mid-way

    def __getitem__(self, index: int):
        time.sleep(self.item_s)
        return (*super().__getitem__(index), index)


{% if cookiecutter.with_shards == "yes" %}
class IndexedShards(ShardDataset):
    """ShardDataset whose samples carry their index: `(image, label, index)` (its `__getitems__` makes them here)."""

    def __getitem__(self, index: int):
        return (*super().__getitem__(index), index)


{% endif %}
class RecordingClassification(Classification):
    """Classification of `(inputs, labels, indices)` batches that appends, per training batch, the sample indices to
    `$RECORD_SAMPLES-rank<RANK>.jsonl` with its process id and the task object's number in that process (one per
    run: tests.helpers.run_batches reads them). The place comes from the environment, so a resumed run's command
    stays the run's own."""

    built = 0  # task objects this process has built

    def __init__(self, label_smoothing: float = 0.0):
        super().__init__(label_smoothing)
        RecordingClassification.built += 1
        self.record, self.number = os.environ.get("RECORD_SAMPLES"), RecordingClassification.built

    def loss(self, model, batch):
        inputs, labels, indices = batch
        if self.record is None:
            return super().loss(model, (inputs, labels))
        line = {"pid": os.getpid(), "task": self.number, "indices": indices.tolist()}
        with open(f"{self.record}-rank{os.environ.get('RANK', '0')}.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
        return super().loss(model, (inputs, labels))

    def metrics(self, model, batch):
        inputs, labels, _ = batch
        return super().metrics(model, (inputs, labels))


class Linear(torch.nn.Module):
    """A linear classifier of flattened inputs: no batch statistics, so a step over one global batch is the same
    computation (up to the order of float sums) however many processes share the batch."""

    def __init__(self, num_classes: int, in_features: int):
        super().__init__()
        self.head = torch.nn.Linear(in_features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x.flatten(1))


class IndexedDraws(Dataset):
    """Each item is (its index, what it drew from torch, numpy and python `random`): which sample got which draw."""

    def __init__(self, size: int = 48):
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        draws = [float(torch.rand(())), float(np.random.uniform()), random.random()]
        return index, torch.tensor(draws, dtype=torch.float64)


class SometimesDraws(IndexedDraws):
    """Every item draws from torch; from numpy only every 5th index and from python `random` only every 7th (as a
    transform that draws from them on some branch), or only at the indices `numpy_at` and `python_at` when given:
    the -1 marks a draw not taken. `restore`: numpy's state is put back after its draw, which hides the draw."""

    def __init__(self, size: int = 48, numpy_at=None, python_at=None, restore: bool = False):
        super().__init__(size)
        self.numpy_at = {i for i in range(size) if i % 5 == 3} if numpy_at is None else set(numpy_at)
        self.python_at = {i for i in range(size) if i % 7 == 2} if python_at is None else set(python_at)
        self.restore = restore

    def __getitem__(self, index: int):
        draws = [float(torch.rand(())), -1.0, -1.0]
        if index in self.numpy_at:
            state = np.random.get_state()
            draws[1] = float(np.random.uniform())
            if self.restore:
                np.random.set_state(state)
        if index in self.python_at:
            draws[2] = random.random()
        return index, torch.tensor(draws, dtype=torch.float64)


def collate_with_numpy_draw(samples):
    """default_collate, plus one numpy draw per batch: a collate that draws from a global generator."""
    indices, draws = torch.utils.data.default_collate(samples)
    return indices, draws, torch.tensor(np.random.uniform(), dtype=torch.float64)


class SlowItems(RngDrawingDataset):
    """RngDrawingDataset whose items take `item_s` seconds each, like slow storage: workers stay busy long enough
    to watch."""

    def __init__(self, size: int = 256, num_classes: int = 4, image_size: int = 16, item_s: float = 0.01):
        super().__init__(size, num_classes, image_size)
        self.item_s = item_s

    def __getitem__(self, index: int):
        time.sleep(self.item_s)
        return super().__getitem__(index)


{% if cookiecutter.with_streams == "yes" %}
class CountingShards(ShardStream):
    """A shard stream of unequal shards: record `i` of shard `s` is `(x, label, s * 1000 + i)`, its input drawing
    from torch, numpy and python `random` like RngDrawingDataset's, so any RNG slip shows in the weights. `sizes`:
    records per shard; `with_sizes=False` leaves them unsaid; `bad`: keys whose record raises; `refused`: keys whose
    record raises a UserError; `claimed`: the sizes it says it has, when they are not its sizes."""

    def __init__(
        self,
        sizes=(37, 5, 60, 18, 41, 9, 26, 14),
        num_classes: int = 4,
        image_size: int = 4,
        with_sizes: bool = True,
        bad=(),
        item_s: float = 0,
        refused=(),
        claimed=None,
    ):
        super().__init__(range(len(sizes)), (claimed or sizes) if with_sizes else None)
        self.per_shard, self.num_classes, self.image_size = list(sizes), num_classes, image_size
        self.bad, self.item_s, self.refused = set(bad), item_s, set(refused)

    def records(self, shard: int):
        return ((shard, i) for i in range(self.per_shard[shard]))

    def decode(self, record):
        shard, i = record
        key = shard * 1000 + i
        if key in self.bad:
            raise ValueError(f"record {key} is corrupt")
        if key in self.refused:  # the data set's own one-line message, as a reader that checks its files has
            raise UserError(f"shard {shard} changed on disk since its sizes were counted: count them again")
        if torch.utils.data.get_worker_info() is not None:  # slow storage for the loader, not for the config check
            time.sleep(self.item_s)
        label = (shard * 7 + i) % self.num_classes
        x = torch.full((3, self.image_size, self.image_size), float(label) / self.num_classes)
        x = x + 0.3 * torch.randn_like(x) + float(np.random.uniform(-0.1, 0.1)) + random.gauss(0.0, 0.1)
        return x, label, key


class ReadOnlyShards(CountingShards):
    """The same records through a `read(shard)` that cannot start inside a shard (no `start`)."""

    def read(self, shard):
        return super().read(shard)


class SplitStream(IterableDataset):
    """A plain stream of `size` records that splits itself over the DataLoader's workers (worker `w` of `W` yields
    records `w, w + W, ...`), each `(x, label, index)` with RNG draws like CountingShards'."""

    def __init__(self, size: int = 150, num_classes: int = 4, image_size: int = 4):
        self.size, self.num_classes, self.image_size = size, num_classes, image_size
        self.next_index: int | None = None  # where a restored state starts
        self.position = 0

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        start, self.next_index = (self.next_index if self.next_index is not None else worker), None
        for index in range(start, self.size, workers):
            self.position = index + workers
            label = index % self.num_classes
            x = torch.full((3, self.image_size, self.image_size), float(label) / self.num_classes)
            yield x + 0.3 * torch.randn_like(x) + float(np.random.uniform(-0.1, 0.1)), label, index


class StatefulStream(SplitStream):
    """SplitStream with the Stateful protocol torchdata uses: where it stands, and back there."""

    def state_dict(self) -> dict:
        return {"next": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.next_index = state["next"]


class FixedStream(IterableDataset):
    """A plain stream of `size` fixed records (no randomness: a validation set read twice gives the same batches),
    `(x, label)` with x `dim` floats. It splits itself over torchrun's processes (RANK, WORLD_SIZE, as WebDataset's
    split_by_node reads them) and the DataLoader's workers: reader `r` of `R` yields records `r, r + R, ...`."""

    def __init__(self, size: int = 50, dim: int = 6, num_classes: int = 2):
        self.size, self.dim, self.num_classes = size, dim, num_classes

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        rank, ranks = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        for index in range(rank * workers + worker, self.size, ranks * workers):
            label = index % self.num_classes
            yield torch.cos(torch.arange(self.dim) * (0.3 + index / self.size)) + label, label


{% endif %}
def dict_collate(samples) -> dict:
    """A `data.collate` of your own: the batch as a dict, `{"image": (N, C, H, W), "label": (N,)}`."""
    images, labels = torch.utils.data.default_collate(samples)
    return {"image": images, "label": labels}


class DictClassification:
    """A classification task reading dict batches (those of `dict_collate`)."""

    def loss(self, model, batch):
        return torch.nn.functional.cross_entropy(model(batch["image"]), batch["label"])

    def metrics(self, model, batch):
        logits = model(batch["image"])
        right = (logits.argmax(1) == batch["label"]).sum()
        return {"acc": right, "count": batch["label"].new_tensor(batch["label"].numel())}


class CallCountedMixUp:
    """MixUp whose lambda comes from a generator seeded with its own call count: what a batch transform without
    the (seed, epoch, batch) keying does. The count starts again at 0 in a resumed process."""

    def __init__(self, num_classes: int):
        self.num_classes, self.calls = num_classes, 0

    def __call__(self, batch):
        images, labels = batch
        lam = float(torch.rand((), generator=torch.Generator().manual_seed(self.calls)))
        self.calls += 1
        soft = torch.nn.functional.one_hot(labels, self.num_classes).float()
        return images * lam + images.roll(1, 0) * (1 - lam), soft * lam + soft.roll(1, 0) * (1 - lam)


class PartedClassification(Classification):
    """Cross-entropy plus an L2 penalty on the weights, returned as `(loss, parts)`: each part logged on its own."""

    def loss(self, model, batch):
        ce = super().loss(model, batch)
        l2 = 1e-3 * sum(p.square().sum() for p in model.parameters())
        return ce + l2, {"ce": ce, "l2": l2}


class Tokens(Classification):
    """Classification whose `count` eval.py names as tokens, as a language model's task would (tasks.py)."""

    count_unit = "tokens"


class MeanIoU(Classification):
    """A dataset-level metric: per-class intersection and union vectors summed over the split, turned into the
    mean IoU over the classes present by `compute` (the mean of per-batch IoUs would be another, wrong, figure)."""

    def __init__(self, label_smoothing: float = 0.0, num_classes: int = 4):
        super().__init__(label_smoothing)
        self.num_classes = num_classes

    def metrics(self, model, batch):
        inputs, labels = batch
        predicted = torch.nn.functional.one_hot(model(inputs).argmax(1), self.num_classes)
        truth = torch.nn.functional.one_hot(labels, self.num_classes)
        intersection = (predicted * truth).sum(0)
        union = (predicted + truth).clamp(max=1).sum(0)
        return {"intersection": intersection, "union": union, "count": labels.new_tensor(labels.numel())}

    def compute(self, totals):
        present = totals["union"] > 0
        iou = totals["intersection"][present] / totals["union"][present]
        return {"miou": iou.mean(), "pixel_acc": totals["intersection"].sum() / totals["count"]}


class TrainModeMetrics(Classification):
    """Validation that runs the model in training mode: BatchNorm's running statistics move with every batch."""

    def metrics(self, model, batch):
        model.train()
        return super().metrics(model, batch)


class DivergingClassification(Classification):
    """Classification whose loss becomes inf from the `after`+1-th call on, as a run whose loss diverges (the checks'
    dry step makes the first call)."""

    def __init__(self, label_smoothing: float = 0.0, after: int = 20):
        super().__init__(label_smoothing)
        self.after, self.calls = after, 0

    def loss(self, model, batch):
        self.calls += 1
        loss = super().loss(model, batch)
        return loss + float("inf") if self.calls > self.after else loss


class HangsOnce(RngDrawingDataset):
    """RngDrawingDataset whose sample `hang_index` blocks forever the first time any process reads it, like a read
    from a dead network mount: `marker` (a file) records that it happened, so a resumed run reads it normally."""

    def __init__(self, marker: str, hang_index: int, size: int = 256, num_classes: int = 4, image_size: int = 16):
        super().__init__(size, num_classes, image_size)
        self.marker, self.hang_index = marker, hang_index

    def __getitem__(self, index: int):
        if index == self.hang_index and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            threading.Event().wait()  # never set: blocked until the process is ended
        return super().__getitem__(index)


class SideTensorSamples(RngDrawingDataset):
    """Dict samples `{"image": uint8 (3, H, W), "label": int, "side": uint8 (4,)}`: `side` is a tensor beside the
    model's input (`data.input=image`), uint8 like an image, which must reach the task untouched (its value is
    `SIDE(label)`, checked by MacroRecall). `draws=False`: fixed samples, from the index alone."""

    def __getitem__(self, index: int):
        image, label = super().__getitem__(index)
        pixels = (image.clamp(0, 1) * 255).round().to(torch.uint8)
        return {"image": pixels, "label": label, "side": torch.full((4,), side_value(label), dtype=torch.uint8)}


def side_value(label):
    return label * 50 + 5


class MacroRecall:
    """Dict batches of SideTensorSamples. The loss is `(ce + l2, {"ce", "l2"})`; validation reports a
    dataset-level figure, `val_macro_recall` (the mean over classes of hits / support, from the split's per-class
    totals), and `val_side_off`, how many side values arrived changed (0 when `data.normalize` left them alone)."""

    def __init__(self, num_classes: int = 4):
        self.num_classes = num_classes

    def loss(self, model, batch):
        ce = torch.nn.functional.cross_entropy(model(batch["image"]), batch["label"])
        l2 = 1e-3 * sum(p.square().sum() for p in model.parameters())
        return ce + l2, {"ce": ce, "l2": l2}

    def metrics(self, model, batch):
        side = batch["side"]
        if side.dtype != torch.uint8:  # metadata: no read from the device
            raise TypeError(f"the side tensor arrived as {side.dtype}, not uint8: something touched it")
        truth = torch.nn.functional.one_hot(batch["label"], self.num_classes)
        hit = (model(batch["image"]).argmax(1) == batch["label"]).unsqueeze(1)
        off = (side.long() != side_value(batch["label"]).unsqueeze(1)).sum()
        count = batch["label"].new_tensor(batch["label"].numel())
        return {"hits": (truth * hit).sum(0), "support": truth.sum(0), "side_off": off, "count": count}

    def compute(self, totals):
        present = totals["support"] > 0
        recall = totals["hits"][present] / totals["support"][present]
        return {"macro_recall": recall.mean(), "side_off": totals["side_off"]}


class CountingCallback:
    """A callback of the tests' own, with state: the log lines and validations it saw, and the sum of the losses
    logged. A resumed run's must end where the straight run's ends."""

    def __init__(self):
        self.logs, self.validations, self.loss_sum = 0, 0, 0.0

    def on_log(self, run, figures: dict) -> None:
        self.logs += 1
        self.loss_sum += figures["loss"]

    def on_validation_end(self, run, record: dict) -> None:
        self.validations += 1

    def state_dict(self) -> dict:
        return {"logs": self.logs, "validations": self.validations, "loss_sum": self.loss_sum}

    def load_state_dict(self, state: dict) -> None:
        self.logs, self.validations, self.loss_sum = state["logs"], state["validations"], state["loss_sum"]


class Detections(Dataset):
    """Detection-style samples: an image whose size varies (3, s, s) and a dict of targets, batched by
    `detection_collate` as (list of images, list of dicts)."""

    def __init__(self, size: int = 64, num_classes: int = 4):
        self.size, self.num_classes = size, num_classes

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        label = index % self.num_classes
        side = 6 + index % 3
        return torch.full((3, side, side), label / self.num_classes) + 0.1 * torch.randn(3, side, side), {
            "label": torch.tensor(label)
        }


def detection_collate(samples):
    images, targets = zip(*samples)
    return list(images), list(targets)


def reference_collate(samples):
    """torchvision's detection references' collate: (tuple of images, tuple of targets)."""
    return tuple(zip(*samples))


class PooledLinear(torch.nn.Module):
    """A classifier of a list of images of any size: each image's channel means, then a linear layer."""

    def __init__(self, num_classes: int):
        super().__init__()
        self.head = torch.nn.Linear(3, num_classes)

    def forward(self, images: list) -> torch.Tensor:
        return self.head(torch.stack([image.mean(dim=(1, 2)) for image in images]))


class DetectionTask:
    """Classification of (list of images, list of {"label"}) batches."""

    def loss(self, model, batch):
        images, targets = batch
        return torch.nn.functional.cross_entropy(model(images), torch.stack([t["label"] for t in targets]))

    def metrics(self, model, batch):
        images, targets = batch
        labels = torch.stack([t["label"] for t in targets])
        logits = model(images)
        return {
            "loss": torch.nn.functional.cross_entropy(logits, labels, reduction="sum"),
            "acc": (logits.argmax(1) == labels).sum(),
            "count": torch.tensor(len(images)),
        }


def project_features(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x @ weight  # BuggyModel's bug: x has 3 features, weight expects 16


class BuggyModel(torch.nn.Module):
    """A user's model with a bug in a helper its forward calls (a wrong shape): their code's error, not bad input."""

    def __init__(self, num_classes: int = 4):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(16, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project_features(x.flatten(1)[:, :3], self.weight)


class BrokenInit(torch.nn.Module):
    """A user's model whose __init__ has a bug."""

    def __init__(self, num_classes: int = 4):
        super().__init__()
        self.layers = [torch.nn.Linear(8, num_classes)][num_classes]  # an IndexError: the list has one entry


class FailingCallback:
    """A user's callback with a bug in on_log, which only training calls."""

    def on_log(self, run, figures: dict) -> None:
        ratio = figures["loss"] / figures["no such figure"]  # a KeyError
        print(ratio)


class FailsAtIndex(RngDrawingDataset):
    """RngDrawingDataset whose sample `bad` raises in a helper of the data set's own (a bug, not a bad file)."""

    def __init__(self, size: int = 200, bad: int = 50, **kwargs):
        super().__init__(size, **kwargs)
        self.bad = bad

    def __getitem__(self, index: int):
        return self.checked(index, super().__getitem__(index))

    def checked(self, index: int, sample):
        if index == self.bad:
            raise ValueError(f"sample {index} has no label")
        return sample


class Albumented(RngDrawingDataset):
    """RngDrawingDataset's fixed inputs through an albumentations 2 pipeline of the data set's own (a flip, noise),
    which draws from the pipeline's generators, not the global ones; `seed` as albumentations' Compose takes it."""

    def __init__(self, size: int = 200, seed: int | None = None, **kwargs):
        super().__init__(size, draws=False, **kwargs)
        self.augment = albumentations.Compose(
            [albumentations.HorizontalFlip(p=0.5), albumentations.GaussNoise(std_range=(0.1, 0.3), p=1.0)], seed=seed
        )

    def __getitem__(self, index: int):
        x, label = super().__getitem__(index)
        image = self.augment(image=x.permute(1, 2, 0).numpy())["image"]  # albumentations works on (H, W, C)
        return torch.from_numpy(image).permute(2, 0, 1).contiguous(), label


class OwnGenerator(RngDrawingDataset):
    """RngDrawingDataset's fixed inputs plus noise from a numpy Generator of the data set's own: nothing the run
    seeds or saves."""

    def __init__(self, size: int = 200, **kwargs):
        super().__init__(size, draws=False, **kwargs)
        self.noise = np.random.default_rng()

    def __getitem__(self, index: int):
        x, label = super().__getitem__(index)
        return x + torch.from_numpy(self.noise.normal(0, 0.1, x.shape).astype(np.float32)), label
