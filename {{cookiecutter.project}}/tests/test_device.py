"""The host/device boundary: batches handed through unchanged on the CPU, uint8 normalized on the device, amp values,
data.input needed only where something works on the input, each stage of preparing a batch refused in one line
naming its key, and trainings with bf16 autocast and channels_last that still resume exactly."""

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf
from PIL import Image
from torch.utils.data import DataLoader, TensorDataset

from {{ cookiecutter.package }}.engine import schema
from {{ cookiecutter.package }}.engine.device import (
    Normalize,
    PrepareBatch,
    amp_dtype,
    device_batches,
    input_transform,
    sum_and_read,
)
from {{ cookiecutter.package }}.engine.dry_step import dry_step
from {{ cookiecutter.package }}.engine.errors import UserError
from {{ cookiecutter.package }}.engine.run import build_problem
from tests.helpers import PROJECT, RNG_DATA, load_ckpt, run_train, same_weights

CPU = torch.device("cpu")


def test_cpu_batches_pass_through_in_order():
    def loader():
        data = TensorDataset(torch.randn(40, 3), torch.arange(40))
        return DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1))

    torch.manual_seed(0)
    got = list(device_batches(loader(), CPU))
    torch.manual_seed(0)
    expected = list(loader())
    assert len(device_batches(loader(), CPU)) == 5 and len(got) == 5
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, expected, strict=True))
    batches = [(torch.zeros(2), torch.ones(2)) for _ in range(3)]
    assert all(a is b for a, b in zip(device_batches(batches, CPU), batches, strict=True))  # the same objects


def test_normalize_uint8_on_the_device_and_float_passes():
    x = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8)
    mean, std = [0.5, 0.4, 0.3], [0.2, 0.25, 0.3]
    out = Normalize(mean, std)(x)
    expected = (x.float() / 255 - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    assert out.dtype == torch.float32 and torch.allclose(out, expected, atol=1e-6)
    assert not torch.equal(out, x.float() / 255)  # negative control: the statistics are applied
    floats = torch.randn(4, 3, 8, 8)
    assert Normalize(mean, std)(floats) is floats  # a dataset's own float tensors are left alone
    assert torch.equal(Normalize()(x), x.float().div(255))
    nhwc = Normalize(mean, std, channels_last=True)(x)
    assert nhwc.is_contiguous(memory_format=torch.channels_last) and torch.equal(nhwc, out)


def test_only_the_named_input_is_normalized():
    mean, std = [0.5, 0.5, 0.5], [0.25, 0.25, 0.25]
    image = torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8)
    mask = torch.randint(0, 3, (2, 1, 4, 4), dtype=torch.uint8)  # a class index per pixel: not an image
    expected = Normalize(mean, std)(image)
    out = PrepareBatch(Normalize(mean, std), "image")({"image": image, "mask": mask, "ids": torch.arange(2)})
    assert torch.equal(out["image"], expected) and out["mask"] is mask and out["ids"].dtype == torch.int64
    x, y = PrepareBatch(Normalize(mean, std), 1)((mask, image))  # a position in a tuple batch
    assert x is mask and torch.equal(y, expected)
    # negative control: the mask named as the input is normalized like an image
    assert PrepareBatch(Normalize(), "mask")({"image": image, "mask": mask})["mask"].dtype == torch.float32
    with pytest.raises(UserError, match=r"data.input='img' is not in the batch \(a dict with keys image, mask\)"):
        PrepareBatch(Normalize(), "img")({"image": image, "mask": mask})


def test_data_input_is_needed_only_where_something_works_on_the_input():
    """A config older than data.input (dict batches, nothing set that works on the input) prepares its batches as it
    did then: every (N, C, H, W) uint8 tensor scaled to [0, 1], the rest untouched. Each key that works on the input
    makes a data.input that names no part of the batch a refusal naming that key."""
    image = torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8)
    batch = {"image": image, "side": torch.randint(0, 256, (2, 4), dtype=torch.uint8), "price": torch.randn(2)}
    out = input_transform(OmegaConf.create({}), CPU)(batch)
    assert torch.equal(out["image"], image.float() / 255) and out["side"] is batch["side"]
    assert out["price"] is batch["price"]
    normalize = {"_target_": "{{ cookiecutter.package }}.engine.device.Normalize", "mean": [0.5] * 3}
    mixup = {"_target_": "torchvision.transforms.v2.MixUp", "num_classes": 4}
    refused = r"data.input=\S+ is not in the batch \(a dict with keys image, side, price\): set data.input to the "
    for data, channels_last, named in (
        ({"normalize": normalize}, False, "data.normalize works on"),
        ({"batch_transform": mixup}, False, "data.batch_transform works on"),
        ({}, True, "channels_last works on"),
        ({"normalize": normalize, "input": "img"}, True, "data.normalize, channels_last work on"),
    ):
        with pytest.raises(UserError, match=refused + f".* the part {named}$"):
            input_transform(OmegaConf.create(data), CPU, channels_last)(batch)
        # control: the same config with data.input naming the image prepares it
        prepared = input_transform(OmegaConf.create({**data, "input": "image"}), CPU, channels_last)(batch)
        assert prepared["image"].dtype == torch.float32 and prepared["side"] is batch["side"]


# One stage of preparing the dry step's first batch fails: (overrides on RNG_DATA, the start of the one line). The
# data set's images are floats, except GrayImages' uint8 images of one channel, for the RGB data.normalize of shapes.
STAGES = [
    (
        ["data.train._target_=tests.datasets.GrayImages"],
        "error: data.normalize ({{ cookiecutter.package }}.engine.device.Normalize) fails on 2 training samples: "
        "RuntimeError: output with shape [2, 1, 16, 16] doesn't match the broadcast shape [2, 3, 16, 16]",
    ),
    (
        ["+data.collate={_target_: torch.stack, _partial_: true}"],
        "error: data.collate (torch.stack) fails on 2 training samples: TypeError: expected Tensor as element 0",
    ),
    (
        ["data.input=image"],
        "error: data.input='image' is not in the batch (a list with 2 parts): set data.input to the position or key "
        "of the model's input, the part data.normalize works on",
    ),
    (
        ["+data.batch_transform={_target_: torchvision.transforms.v2.MixUp, num_classes: 1}"],
        "error: data.batch_transform (torchvision.transforms.v2.MixUp) fails on 2 training samples: RuntimeError: "
        "Class values must be smaller than num_classes.",
    ),
    (
        ["channels_last=true", "model._target_=torch.nn.Conv3d", "~model.width", "~model.num_classes"]
        + ["+model.in_channels=3", "+model.out_channels=4", "+model.kernel_size=1"],
        "error: channels_last=true fails on model torch.nn.Conv3d: RuntimeError: required rank 4 tensor to use "
        "channels_last format",
    ),
]


# Through train.py a start of torch each: the first stage in the fast tier, the others in the slow one (the dry step
# they all go through is checked in this process below, test_grayscale_...).
SLOW_STAGES = {"collate", "input", "batch_transform", "channels_last"}
STAGE_IDS = ["normalize", "collate", "input", "batch_transform", "channels_last"]


@pytest.mark.parametrize(
    "overrides, line",
    [pytest.param(*stage, id=i, marks=[pytest.mark.slow] * (i in SLOW_STAGES)) for stage, i in zip(STAGES, STAGE_IDS)],
)
def test_each_stage_of_preparing_a_batch_is_refused_in_one_line_naming_its_key(tmp_path, overrides, line):
    proc = run_train(tmp_path / "run", *RNG_DATA, *overrides, expect=2)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(line), proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr and not (tmp_path / "run").exists()


def test_grayscale_images_pass_the_dry_step_with_a_normalize_of_one_channel():
    """The line above says what to change: with a data.normalize of one channel (and a model taking one), the same
    grayscale data passes the dry step; the control, the RGB normalize of shapes, is refused naming data.normalize."""
    gray = [*RNG_DATA, "data.train._target_=tests.datasets.GrayImages", "data.val._target_=tests.datasets.GrayImages"]
    one_channel = ["data.normalize.mean=[0.5]", "data.normalize.std=[0.25]", "+model.in_channels=1"]
    schema.register()
    with initialize_config_dir(str(PROJECT / "conf"), version_base="1.3"):
        fitting, rgb = compose("config", [*gray, *one_channel]), compose("config", [*gray, "+model.in_channels=1"])
    assert dry_step(fitting, build_problem(fitting, CPU, resuming=False)) == []
    with pytest.raises(UserError, match=r"^data.normalize \(.*Normalize\) fails on 2 training samples: RuntimeError"):
        dry_step(rgb, build_problem(rgb, CPU, resuming=False))


def test_sum_and_read_mixes_tensors_and_numbers():
    values = [torch.tensor(1.5), 2, True, torch.tensor(0.25, dtype=torch.float64)]
    assert sum_and_read(values, CPU) == [1.5, 2.0, 1.0, 0.25]


def test_amp_values():
    assert amp_dtype("off", CPU) is None and amp_dtype("bf16", CPU) is torch.bfloat16
    assert amp_dtype("fp16", CPU) is None  # fp16 needs CUDA's GradScaler
    assert amp_dtype("fp16", torch.device("cuda")) is torch.float16
    # any other value: refused by the schema, before the run (the next test: amp=fp8 through train.py)


@pytest.mark.parametrize(
    "override, message",
    [
        ("amp=fp8", "amp must be off, bf16 or fp16"),
        ("log_every_steps=0", "log_every_steps"),
    ],
    ids=["amp", "log_interval"],
)
@pytest.mark.slow  # a start of torch each; the fast tier refuses both in process (test_config.py's BAD)
def test_bad_amp_and_log_interval_are_refused_in_one_line(tmp_path, override, message):
    proc = run_train(tmp_path / "run", *RNG_DATA, override, expect=2)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr


@pytest.mark.slow
def test_bf16_and_channels_last_resume_exactly(tmp_path):
    switches = ["amp=bf16", "channels_last=true", "epochs=2", "rng_mode=per_worker"]
    run_train(tmp_path / "straight", *RNG_DATA, *switches)
    run_train(tmp_path / "first", *RNG_DATA, *switches, "max_steps=7")
    run_train(tmp_path / "second", *RNG_DATA, *switches, f"resume={tmp_path}/first/checkpoints/last.pth")
    assert same_weights(tmp_path / "straight/checkpoints/last.pth", tmp_path / "second/checkpoints/last.pth")
    conv = next(t for t in load_ckpt(tmp_path / "second/checkpoints/last.pth")["model"].values() if t.dim() == 4)
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    # negative control: the switches change the arithmetic, so the float32 run ends elsewhere
    run_train(tmp_path / "fp32", *RNG_DATA, "epochs=2", "rng_mode=per_worker")
    assert not same_weights(tmp_path / "straight/checkpoints/last.pth", tmp_path / "fp32/checkpoints/last.pth")


def compose_data(*overrides):
    schema.register()
    with initialize_config_dir(str(PROJECT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides)).data


@pytest.mark.parametrize("data", ["shapes", "imagefolder", "cifar10"])
def test_builtin_transforms_ship_uint8(data):
    cfg = compose_data(f"data={data}", "data.root=/nowhere", "data.num_classes=3")
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 40, 3), dtype=np.uint8))
    for split in ("train", "val"):
        x = instantiate(cfg[split].transform)(image)
        assert x.dtype == torch.uint8 and tuple(x.shape) == (3, cfg.image_size, cfg.image_size)
    assert isinstance(instantiate(cfg.normalize), Normalize)


def test_augmentation_is_a_config_override():
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 40, 3), dtype=np.uint8))
    out = {}
    for p in (0, 1):
        transform = instantiate(compose_data(f"data.train.transform.transforms.2.p={p}").train.transform)
        torch.manual_seed(0)  # the same crop both times
        out[p] = transform(image)
    assert torch.equal(out[1], out[0].flip(-1)) and not torch.equal(out[0], out[1])
