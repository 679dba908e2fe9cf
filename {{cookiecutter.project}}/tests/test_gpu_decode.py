"""data.decode=gpu's host side (engine/decode.py's CropDecoder, EncodedBatch), all a CPU machine can check: a JPEG
sample is the file's bytes with the box RandomResizedCrop and the flip RandomHorizontalFlip draw from the same seed;
the collate keeps a batch's files as a list, through real workers, the same for any worker count and on resume; and
the batch decoded on the CPU (libjpeg-turbo in nvJPEG's place, the same cut, resize and flip after it) is the batch
data.decode=torchvision makes, to the bit. nvJPEG itself runs on a CUDA machine only; the refusal without CUDA is
tests/test_data.py's, through train.py. The other refusals: a transform the device cannot
finish, a data.collate of one's own, a run training on the CPU, a file the decoder rejects."""

import copy
import io

import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image
from torchvision.io import decode_jpeg
from torchvision.transforms import v2

from {{ cookiecutter.package }}.data import ImageFiles
from {{ cookiecutter.package }}.engine import memory, parts, rng
from {{ cookiecutter.package }}.engine.decode import CropDecoder, EncodedBatch, EncodedImage
from {{ cookiecutter.package }}.engine.device import Normalize, PrepareBatch, input_transform
from {{ cookiecutter.package }}.engine.errors import UserError
from {{ cookiecutter.package }}.engine.loader import TrainLoader
from tests.helpers import loader_settings
from tests.test_data import centre_list, crop_list, photo

CPU = torch.device("cpu")
DEVICE_STEPS = "data.decode=gpu decodes, crops, resizes and flips on the device: the transform must be ToImage, "
NAMES = ("ToImage", "RandomResizedCrop", "RandomHorizontalFlip", "ColorJitter")
ON_THE_CPU = (
    "data.decode=gpu decodes each batch with nvJPEG on the training device, and this run trains on cpu: use "
    "data.decode=auto, or device=cuda"
)


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """Two class folders: RGB JPEG photos of three sizes, a grayscale JPEG and a PNG (which the workers decode)."""
    root = tmp_path_factory.mktemp("gpu") / "photos"
    for name in ("a", "b"):
        (root / name).mkdir(parents=True)
    photo(640, 480, 1).save(root / "a" / "0-wide.jpg", quality=90)
    photo(300, 400, 2).save(root / "a" / "1-tall.jpg", quality=90)
    photo(480, 480, 3).convert("L").save(root / "b" / "2-gray.jpg", quality=90)
    photo(200, 150, 4).save(root / "b" / "3-small.png")
    photo(500, 375, 5).save(root / "b" / "4-photo.jpg", quality=85)
    return root


def on_gpu_reader(dataset: ImageFiles, transform) -> ImageFiles:
    """`dataset` with data.decode=gpu's reader: ImageFiles(decode="gpu") itself is refused on a machine without CUDA,
    while the workers' part of it (bytes read, crops drawn) needs none."""
    twin = copy.copy(dataset)
    twin.reader = CropDecoder(transform, "gpu")
    twin.collate_fn = twin.reader.collate_fn
    return twin


def test_a_jpeg_sample_is_its_bytes_with_the_box_and_flip_the_cpu_path_draws(photos, tmp_path):
    """With the sample's seed, the bytes are the file's, the box is what the training list's own RandomResizedCrop
    draws on the file and the flip what its RandomHorizontalFlip draws next; validation's box is the one decode=
    torchvision cuts. Decoded on the CPU, either list gives decode=torchvision's image to the bit. A PNG and a CMYK
    JPEG come as pixels decoded in the worker, as decode=auto decodes them. Negative control: over ten seeds the
    flip goes both ways and the boxes differ."""
    train_list = crop_list(64)
    reader = CropDecoder(train_list, "gpu")
    data = (photos / "a" / "0-wide.jpg").read_bytes()
    file = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    flips, boxes = set(), set()
    for seed in range(10):
        rng.seed_sample(seed)
        sample = reader(data)
        rng.seed_sample(seed)
        with Image.open(io.BytesIO(data)) as image:
            drawn = train_list.transforms[1].make_params([image])
        flip = bool(torch.rand(1) < 0.5)
        assert isinstance(sample, EncodedImage) and torch.equal(sample.data, file)
        top, left = drawn["top"], drawn["left"]
        assert sample.box == (top, left, top + drawn["height"], left + drawn["width"]) and sample.flip == flip
        flips.add(sample.flip)
        boxes.add(sample.box)
    assert flips == {True, False} and len(boxes) == 10
    cmyk = tmp_path / "cmyk.jpg"
    photo(640, 480, 6).convert("CMYK").save(cmyk, quality=90)
    files = sorted(p for p in photos.rglob("*.*")) + [cmyk]
    for transform in (train_list, centre_list(64)):
        gpu, tv, auto = (CropDecoder(transform, d) for d in ("gpu", "torchvision", "auto"))
        samples, want = [], []
        for seed, path in enumerate(files):
            for decoder, out in ((gpu, samples), (tv if path != cmyk else auto, want)):
                rng.seed_sample(seed)
                out.append(decoder(path.read_bytes()))
        kinds = [isinstance(s, EncodedImage) for s in samples]
        assert kinds == [p.suffix == ".jpg" and p != cmyk for p in files]
        batch = gpu.collate([(s, i) for i, s in enumerate(samples)])
        images = batch[0].to_images(CPU)
        assert images.shape == (len(files), 3, 64, 64) and images.dtype == torch.uint8
        for i, path in enumerate(files):
            assert torch.equal(images[i], want[i]), (transform, path.name)


def test_the_collate_keeps_the_files_a_list_for_any_worker_count_and_on_resume(photos):
    """Through TrainLoader's workers (shared memory, pickling), a batch's image part is one EncodedBatch: its files
    the JPEG files' bytes, of their own lengths, nothing stacked, the PNG as pixels, the labels a tensor; the prefetch
    plan counts its bytes. Decoded on the CPU through PrepareBatch, the batches of 0 and 2 workers and of a loader
    stopped mid-epoch and resumed are decode=torchvision's, normalized, to the bit. An all-PNG batch is default
    collate's tensor. Negative control: another seed gives other batches."""
    transform = crop_list(32)
    tv = ImageFiles(photos, transform, decode="torchvision")
    gpu = on_gpu_reader(tv, transform)
    prepare = PrepareBatch(Normalize(), 0, CPU)
    lengths = {p.stat().st_size for p in photos.rglob("*.jpg")}

    def batches(dataset, workers, seed=4, stop=None, state=None, collate_fn=None):
        loader = TrainLoader(dataset, loader_settings(2, workers), seed=seed, collate_fn=collate_fn)
        if state is not None:
            loader.load_state_dict(state)
        out = []
        for _ in range(2):  # two epochs
            for batch in loader:
                if collate_fn is not None and isinstance(batch[0], EncodedBatch):
                    assert set(batch[0].lengths) <= lengths and sum(batch[0].lengths) == batch[0].data.numel()
                    assert batch[1].dtype == torch.int64
                    assert memory.batch_bytes(batch) == batch[0].nbytes + batch[1].nbytes
                out.append(prepare(batch)[0].clone())
                if stop is not None and len(out) == stop:
                    return out, loader.state_dict()
        return out, None

    want, _ = batches(tv, 0)
    assert len(want) == 4
    for workers in (0, 2):
        got, _ = batches(gpu, workers, collate_fn=gpu.collate_fn)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), workers
    first, state = batches(gpu, 2, stop=3, collate_fn=gpu.collate_fn)
    rest, _ = batches(gpu, 0, state=state, collate_fn=gpu.collate_fn)
    assert all(torch.equal(a, b) for a, b in zip(first + rest[:1], want, strict=True))
    other, _ = batches(gpu, 0, seed=5, collate_fn=gpu.collate_fn)
    assert not any(torch.equal(a, b) for a, b in zip(other, want, strict=True))
    # one batch by hand: the files kept as a list, a PNG's pixels beside them; a batch of PNG alone is stacked
    png = next(i for i, p in enumerate(gpu.paths) if p.endswith(".png"))
    jpg = [i for i, p in enumerate(gpu.paths) if p.endswith(".jpg")]
    batch = gpu.collate_fn([gpu[i] for i in [jpg[0], png, jpg[1]]])
    assert isinstance(batch[0], EncodedBatch) and batch[0].at == [0, 2] and batch[0].pixels.shape == (1, 3, 32, 32)
    assert batch[0].lengths == [len(gpu.read(jpg[0])), len(gpu.read(jpg[1]))]
    assert "2 JPEG files" in memory.layout(batch) and "1x3x32x32 uint8" in memory.layout(batch)
    stacked = gpu.collate_fn([gpu[png], gpu[png]])
    assert isinstance(stacked[0], torch.Tensor) and stacked[0].shape == (2, 3, 32, 32)
    # in a worker the collate itself puts both buffers in shared memory (inside the fetch, as CollateWithSnapshot does)
    indices = [jpg[0], png]
    loader = torch.utils.data.DataLoader(gpu, batch_sampler=[indices], num_workers=1, collate_fn=collate_and_ask)
    assert next(iter(loader))[1] == (True, True)
    assert collate_and_ask([gpu[i] for i in indices])[1] == (False, False)  # negative control: in this process


def collate_and_ask(samples):
    """CropDecoder.collate (of the fixture's training list), and whether its buffers are in shared memory as it
    returns them."""
    batch = CropDecoder(crop_list(32), "gpu").collate(samples)
    return batch, (batch[0].data.is_shared(), batch[0].pixels.is_shared())


def test_what_the_device_cannot_finish_is_refused_in_one_line(photos):
    """A transform with a step the device would have to run off the sample's generator (ColorJitter), or none at all;
    a data.collate of one's own (it would be handed files); a run that trains on the CPU; a file the decoder rejects,
    which the workers never decoded. Negative controls: the shipped lists, no data.collate, data.decode=auto."""
    jitter = v2.Compose([*crop_list(32).transforms, v2.ColorJitter(0.2)])
    with pytest.raises(UserError, match=rf"^{DEVICE_STEPS}.*this one is {', '.join(NAMES)}: use data.decode=auto"):
        CropDecoder(jitter, "gpu")
    with pytest.raises(UserError, match="this one is none"):
        CropDecoder(None, "gpu")
    for transform in (crop_list(32), centre_list(32), v2.Compose(crop_list(32).transforms[:2])):
        CropDecoder(transform, "gpu")
    tv = ImageFiles(photos, crop_list(32), decode="torchvision")
    gpu = on_gpu_reader(tv, crop_list(32))
    own = OmegaConf.create({"collate": {"_target_": "tests.test_gpu_decode.collate_and_ask", "_partial_": True}})
    with pytest.raises(UserError, match=r"^data.collate is set, and ImageFiles collates its batches itself \(data"):
        parts.collate(own, gpu)
    none = OmegaConf.create({})
    assert parts.collate(none, gpu) == gpu.reader.collate and parts.collate(none, tv) is None
    assert parts.collate(own, tv).func.__name__ == "collate_and_ask"  # yours, where the data set names none
    with pytest.raises(UserError, match=f"^{ON_THE_CPU}$"):
        input_transform(OmegaConf.create({"decode": "gpu"}), CPU)
    assert isinstance(input_transform(OmegaConf.create({"decode": "auto"}), CPU), PrepareBatch)
    data = (photos / "a" / "0-wide.jpg").read_bytes()
    scan = data.index(b"\xff\xda") + 16  # past the start-of-scan marker: every header marker intact, on any Pillow
    broken = data[:scan] + bytes(len(data) - scan)  # the scan zeroed
    with pytest.raises(RuntimeError):
        decode_jpeg(torch.frombuffer(bytearray(broken), dtype=torch.uint8))
    reader = CropDecoder(crop_list(32), "gpu")
    batch = reader.collate([(reader(broken), 0)])
    with pytest.raises(UserError, match=r"^data.decode=gpu: a JPEG file of this batch does not decode on cpu \("):
        batch[0].to_images(CPU)
