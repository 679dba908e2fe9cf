{% if cookiecutter.with_photos == "yes" %}
"""The shapes data set (data.py): the same files for a given recipe, and a folder it did not draw is refused.
data.decode: a JPEG decoded only as far as the transform's first crop needs (CropDecoder), with the box the
transform would draw, the same for any worker count and on resume; grayscale, CMYK, EXIF and 16-bit PNG files as
PIL's convert("RGB") gives them; a broken file raising PIL's own error; digits trained as well either way."""
{% else %}
"""The shapes data set (data.py): the same files for a given recipe, and a folder it did not draw is refused; an
image folder's files come out as torchvision's ImageFolder gives them."""
{% endif %}

import json

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from PIL import Image
{% if cookiecutter.with_photos == "no" %}
from torchvision import datasets
{% endif %}
from torchvision.transforms import v2

from {{ cookiecutter.package }}.data import SHAPES, ImageFiles, make_shapes, shapes
{% if cookiecutter.with_photos == "yes" %}
from {{ cookiecutter.package }}.engine import failures, {% if cookiecutter.with_streams == "no" %}parts, {% endif %}preflight, rng, schema
from {{ cookiecutter.package }}.engine.decode import CropDecoder
from {{ cookiecutter.package }}.engine.errors import UserError
from {{ cookiecutter.package }}.engine.loader import TrainLoader
from tests.helpers import PROJECT, end_workers, loader_settings, read_jsonl, run_train
{% else %}
from {{ cookiecutter.package }}.engine import {% if cookiecutter.with_streams == "no" %}parts, {% endif %}preflight, schema
from {{ cookiecutter.package }}.engine.errors import UserError
from tests.helpers import PROJECT{% if cookiecutter.with_streams == "no" %}, run_train{% endif +%}
{% endif %}


def files(root):
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*.png"))}


def test_make_shapes_is_a_function_of_its_recipe(tmp_path):
    make_shapes(tmp_path / "a", per_class=5, image_size=16, data_seed=7)
    make_shapes(tmp_path / "b", per_class=5, image_size=16, data_seed=7)
    make_shapes(tmp_path / "c", per_class=5, image_size=16, data_seed=8)
    a = files(tmp_path / "a")
    assert len(a) == 4 * (5 + 1) and a == files(tmp_path / "b")  # 5 train and 1 val image per class
    assert a.keys() == files(tmp_path / "c").keys() and a != files(tmp_path / "c")
    assert json.loads((tmp_path / "a/shapes.json").read_text())["data_seed"] == 7
    assert not list(tmp_path.glob(".*tmp*"))  # built aside and renamed into place


def test_reuse_with_another_recipe_is_refused(tmp_path):
    make_shapes(tmp_path / "s", per_class=3, image_size=16, data_seed=1)
    make_shapes(tmp_path / "s", per_class=3, image_size=16, data_seed=1)  # the same recipe: reused
    with pytest.raises(UserError, match="drawn with other settings"):
        make_shapes(tmp_path / "s", per_class=3, image_size=20, data_seed=1)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine/notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not a generated shapes folder"):
        make_shapes(tmp_path / "mine", per_class=3, image_size=16, data_seed=1)
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]  # nothing drawn into it


def test_shapes_split_reads_as_image_files(tmp_path):
    train = shapes(tmp_path / "s", "train", per_class=4, image_size=16, data_seed=3)
    assert len(train) == 16 and sorted(set(train.labels.tolist())) == list(range(len(SHAPES)))
    image, label = train[5]
    assert image.size == (16, 16) and isinstance(label, int)
    assert isinstance(train.paths, np.ndarray)  # one object, not one per file (copy-on-read in workers)


def test_missing_folder_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        ImageFiles(tmp_path / "nothing")


def data_root(*overrides) -> str:
    schema.register()
    with initialize_config_dir(str(PROJECT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides)).data.root


def shapes_config(root, per_class: int) -> OmegaConf:
    """The part of a run's config that preflight.precheck_data reads, for data=shapes in `root`."""
    train = {"_target_": "{{ cookiecutter.package }}.data.shapes", "root": str(root), "split": "train"}
    return OmegaConf.create({"data": {"num_classes": 4, "train": {**train, "per_class": per_class, "image_size": 8}}})


def test_each_recipe_draws_its_own_folder(tmp_path):
    """`python train.py experiment=debug` then `python train.py` (the README's Quick start) must not meet each other's
    folder, in either order: the default root names the recipe."""
    roots = {
        data_root(),
        data_root("experiment=debug"),
        data_root("data.per_class=100"),
        data_root("data.image_size=48"),
    }
    assert roots == {"data/shapes-600-32", "data/shapes-40-32", "data/shapes-100-32", "data/shapes-600-48"}
    # negative control: one folder for two recipes, what the default root was, is refused before the run
    make_shapes(tmp_path / "one", per_class=2, image_size=8, data_seed=2026)
    preflight.precheck_data(shapes_config(tmp_path / "one", per_class=2))
    with pytest.raises(UserError, match="drawn with other settings"):
        preflight.precheck_data(shapes_config(tmp_path / "one", per_class=3))


{% if cookiecutter.with_photos == "yes" %}
# ---------------------------------------------------------------------------------------------- data.decode


def photo(width: int, height: int, seed: int) -> Image.Image:
    """A photo-like RGB image: smooth colour fields (a coarse random grid, upscaled) and fine grain on top."""
    gen = np.random.default_rng(seed)
    coarse = Image.fromarray(gen.integers(0, 256, (6, 8, 3), dtype=np.uint8), "RGB")
    coarse = coarse.resize((width, height), Image.BICUBIC)
    grain = gen.normal(0, 10, (height, width, 3))
    return Image.fromarray(np.clip(np.asarray(coarse) + grain, 0, 255).astype(np.uint8), "RGB")


def crop_list(size: int, scale=(0.3, 1.0)) -> v2.Compose:
    """The shipped training list: ToImage, RandomResizedCrop, RandomHorizontalFlip."""
    crop = v2.RandomResizedCrop(size, scale=scale, antialias=True)
    return v2.Compose([v2.ToImage(), crop, v2.RandomHorizontalFlip()])


def centre_list(size: int) -> v2.Compose:
    """The shipped validation list: ToImage, Resize (short side), CenterCrop."""
    return v2.Compose([v2.ToImage(), v2.Resize(size, antialias=True), v2.CenterCrop(size)])


def made(dataset, index: int, seed: int) -> torch.Tensor:
    """Sample `index` made after seeding as TrainLoader seeds it (rng_mode=per_sample)."""
    rng.seed_sample(seed)
    return dataset[index][0]


def mean_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.int() - b.int()).abs().float().mean().item()


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory):
    """A class folder of real JPEG files: a 1600x1200 photo (its crops fit a 1/2 or 1/4 scale decode at 64 px), a
    400x300 one, a grayscale one and a CMYK one."""
    root = tmp_path_factory.mktemp("jpegs") / "photos"
    (root / "a").mkdir(parents=True)
    photo(1600, 1200, 1).save(root / "a" / "0-large.jpg", quality=90)
    photo(400, 300, 2).save(root / "a" / "1-small.jpg", quality=90)
    photo(640, 480, 3).convert("L").save(root / "a" / "2-gray.jpg", quality=90)
    photo(640, 480, 4).convert("CMYK").save(root / "a" / "3-cmyk.jpg", quality=90)
    return root


def test_the_box_is_the_transforms_and_a_large_photo_decodes_at_a_smaller_scale(jpegs):
    """With the same sample seed, decode=torchvision (libjpeg-turbo, whole, then the box cut) gives to the bit what
    decode=pil gives (the whole transform on PIL's decode): the box drawn first is the one the transform draws, and
    the flip after it too. decode=auto decodes the large photo at 1/4 scale and comes out within a grey level or two
    of it on average; validation's resize + centre crop, cut first and resized once, within one grey level; a
    camera's MPO file likewise. Negative control: another seed draws another box, tens of grey levels away."""
    train_list = crop_list(64)
    for transform in (train_list, centre_list(64)):
        pil, tv, auto = (ImageFiles(jpegs, transform, decode=d) for d in ("pil", "torchvision", "auto"))
        for index in range(len(pil)):
            want, got, whole = made(pil, index, 11), made(auto, index, 11), made(tv, index, 11)
            if transform is train_list:
                assert torch.equal(whole, want), index
            assert mean_gap(whole, want) < 1, (transform, index)
            assert got.shape == (3, 64, 64) and mean_gap(got, want) < 3, (transform, index)
    train = ImageFiles(jpegs, crop_list(64), decode="auto")
    assert mean_gap(made(train, 0, 11), made(train, 0, 12)) > 10  # the comparison above can fail
    # a camera's MPO file (a JPEG with a second picture after the first): decoded as its first picture, as PIL does
    mpo = jpegs.parent / "camera.jpg"
    photo(1600, 1200, 1).save(mpo, "MPO", save_all=True, append_images=[photo(800, 600, 7)])
    rng.seed_sample(2)
    want = CropDecoder(crop_list(64), "pil")(mpo.read_bytes())
    for decode, gap in (("torchvision", 0), ("auto", 3)):
        rng.seed_sample(2)
        assert mean_gap(CropDecoder(crop_list(64), decode)(mpo.read_bytes()), want) <= gap, decode
    data = (jpegs / "a" / "0-large.jpg").read_bytes()
    for out, wanted in ((64, 8), (200, 4), (400, 2), (700, 1)):  # a 1200 px box: 1/8 holds it at 150 px, 1/4 at 300
        with Image.open(jpegs / "a" / "0-large.jpg") as image:
            pixels = train.reader.region(data, image, (0, 100, 1200, 1200), [out, out])
        assert tuple(pixels.shape) == (3, 1200 // wanted, 1200 // wanted), out  # decoded at 1/wanted


def test_small_photos_grayscale_cmyk_exif_and_16_bit_png_come_out_as_pil_converts_them(jpegs, tmp_path):
    """Where no smaller scale holds the box (224 px from a 400x300 photo), decode=auto gives to the bit what PIL's
    convert("RGB") then the transform give: for RGB and grayscale through torchvision.io (the same libjpeg-turbo
    decode), for CMYK through PIL. A JPEG with EXIF orientation 6 (rotate 90 degrees) comes out unrotated, as
    ImageFolder gives it; a 16-bit PNG as PIL converts it. Negative control: the rotated photo differs."""
    (tmp_path / "x" / "a").mkdir(parents=True)
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 CW to view
    photo(400, 300, 5).save(tmp_path / "x" / "a" / "exif.jpg", quality=90, exif=exif)
    photo(400, 300, 5).rotate(-90, expand=True).save(tmp_path / "x" / "a" / "exif-rotated.jpg", quality=90)
    deep = (np.asarray(photo(300, 300, 6).convert("L"), dtype=np.uint16) * 257).astype(np.uint16)
    Image.fromarray(deep).save(tmp_path / "x" / "a" / "png16.png")
    with Image.open(tmp_path / "x" / "a" / "png16.png") as png:
        assert png.mode.startswith("I")  # 16 bits on disk
    for root, names in ((jpegs, ["1-small", "2-gray", "3-cmyk"]), (tmp_path / "x", ["exif", "exif-rotated", "png16"])):
        transform = crop_list(224, scale=(0.5, 1.0))
        pil, auto = ImageFiles(root, transform, decode="pil"), ImageFiles(root, transform, decode="auto")
        files = [p.split("/")[-1].split(".")[0] for p in pil.paths]
        for index, name in enumerate(files):
            if name in names:
                assert torch.equal(made(auto, index, 3), made(pil, index, 3)), name
    x = ImageFiles(tmp_path / "x", centre_list(224), decode="auto")
    assert mean_gap(made(x, 0, 3), made(x, 1, 3)) > 10  # exif.jpg unrotated is not the rotated photo


def test_a_broken_jpeg_raises_pils_error_with_every_decoder(jpegs, tmp_path):
    """A truncated JPEG raises PIL's OSError whatever data.decode says, so the bad-sample line reads as before: through
    TrainLoader's worker, data.on_bad_sample=error names the file in the line decode=pil gives."""
    (tmp_path / "b" / "a").mkdir(parents=True)
    data = (jpegs / "a" / "1-small.jpg").read_bytes()
    (tmp_path / "b" / "a" / "cut.jpg").write_bytes(data[: len(data) // 2])
    for decode in ("pil", "torchvision", "auto"):
        with pytest.raises(OSError, match="image file is truncated"):
            CropDecoder(crop_list(64), decode)(data[: len(data) // 2])
    assert CropDecoder(crop_list(64), "auto")(data).shape == (3, 64, 64)  # negative control: the whole file decodes
    lines = {}
    for decode in ("pil", "auto"):
        dataset = ImageFiles(tmp_path / "b", crop_list(32), decode=decode)
        loader = TrainLoader(dataset, loader_settings(1, workers=1), seed=0)
        with pytest.raises(failures.BadSample) as caught:
            for _ in loader:
                pass
        end_workers(loader)
        lines[decode] = str(caught.value)
    bad = tmp_path / "b" / "a" / "cut.jpg"
    assert lines["auto"] == lines["pil"] and lines["auto"].startswith(f"data set index 0 (file {bad}): OSError: image")


def test_auto_is_the_same_for_any_worker_count_and_resumes_exactly(jpegs):
    """TrainLoader seeds each sample from (seed, epoch, index): the boxes drawn before decoding, and so the batches,
    are the same with 0 and 2 workers, and a loader stopped mid-epoch and resumed from its state_dict goes on with the
    same batches. Negative control: another seed gives other batches."""
    dataset = ImageFiles(jpegs, crop_list(32), decode="auto")

    def batches(workers, seed=4, stop=None, state=None):
        loader = TrainLoader(dataset, loader_settings(2, workers), seed=seed)
        if state is not None:
            loader.load_state_dict(state)
        out = []
        for _ in range(2):  # two epochs
            for x, _ in loader:
                out.append(x.clone())
                if stop is not None and len(out) == stop:
                    return out, loader.state_dict()
        return out, None

    straight, _ = batches(0)
    assert len(straight) == 4 and all(torch.equal(a, b) for a, b in zip(straight, batches(2)[0], strict=True))
    first, state = batches(2, stop=3)
    rest, _ = batches(0, state=state)
    assert all(torch.equal(a, b) for a, b in zip(first + rest[:1], straight, strict=True))
    assert not any(torch.equal(a, b) for a, b in zip(batches(0, seed=5)[0], straight, strict=True))


NO_CUDA = (
    "data.decode=gpu decodes each batch with nvJPEG on the training device, and this run trains on cpu: use "
    "data.decode=auto, or device=cuda"
)


def test_a_decoder_that_is_not_one_is_refused_in_one_line(tmp_path):
    """A word data.decode does not know is refused naming the choices (train.py's schema check says the same:
    tests/test_config.py)."""
    make_shapes(tmp_path / "s", per_class=2, image_size=8, data_seed=1)
    with pytest.raises(UserError, match=r"data.decode must be auto, pil, torchvision or gpu, got 'fast'"):
        ImageFiles(tmp_path / "s" / "train", decode="fast")
    assert len(ImageFiles(tmp_path / "s" / "train", decode="torchvision")) == 8  # negative control: a word it knows


@pytest.mark.slow  # a start of torch for a refusal; the fast tier's refusals through train.py are test_config.py's
def test_gpu_decode_without_cuda_is_refused_in_one_line(tmp_path):
    """data.decode=gpu on a machine without CUDA is one `error:` line from train.py, before any run folder is made
    (the only test gpu gets on a CPU machine)."""
    make_shapes(tmp_path / "s", per_class=2, image_size=8, data_seed=2026)  # as data=shapes draws it
    if torch.cuda.is_available():
        pytest.skip("CUDA is here: data.decode=gpu is not refused for want of it")
    shapes = [f"data.root={tmp_path / 's'}", "data.per_class=2", "data.image_size=8"]
    proc = run_train(tmp_path / "run", *shapes, "data.decode=gpu", expect=2)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-2000:]
    assert lines[0] == f"error: {NO_CUDA}"
    assert not (tmp_path / "run").exists()


def export_digits_jpeg(root, size: int = 48, val_every: int = 5, scramble: bool = False):
    """scikit-learn's handwritten digits (1,797 real 8x8 scans, shipped with the package) as JPEG files of `size`
    pixels a side, `root/{train,val}/<digit>/<n>.jpg`: every `val_every`-th scan goes to val. `scramble`: each train
    scan under a digit drawn at random instead of its own (what no decoder can learn from)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    wrong = np.random.default_rng(0).integers(0, 10, len(digits.target))
    for n, (image, label) in enumerate(zip(digits.images, digits.target, strict=True)):
        split = "val" if n % val_every == 0 else "train"
        folder = root / split / str(wrong[n] if scramble and split == "train" else label)
        folder.mkdir(parents=True, exist_ok=True)
        scan = Image.fromarray((image * 255 / 16).round().astype(np.uint8), "L").resize((size, size), Image.BILINEAR)
        scan.save(folder / f"{n:04d}.jpg", quality=90)
    return root


@pytest.mark.slow
def test_digits_as_jpeg_train_as_well_with_auto_as_with_pil(tmp_path):
    """48 px grayscale JPEG digits cropped to 16 px: decode=auto decodes most crops at 1/2 scale, and trains to the
    accuracy decode=pil reaches, within a few points (seeds 0-2 gave 0.967-0.983 with auto, 0.958-0.969 with pil).
    Negative control: the train scans under random digits end far behind (0.13), so the accuracy compared is the
    decoder's to lose."""
    pytest.importorskip("sklearn", reason="the test extra brings scikit-learn (pip install -e '.[test]')")
    run = ["data=imagefolder", "data.num_classes=10", "data.image_size=16", "epochs=4", "seed=2", "loader=memory-tight",
           "loader.num_workers=0", "loader.prefetch_factor=null", "progress=false"]  # fmt: skip
    acc = {}
    for name, decode, scramble in (("auto", "auto", False), ("pil", "pil", False), ("scrambled", "auto", True)):
        images = tmp_path / ("scrambled" if scramble else "digits")
        if not images.exists():
            export_digits_jpeg(images, scramble=scramble)
        run_train(tmp_path / name, *run, f"data.root={images}", f"data.decode={decode}", env={"OMP_NUM_THREADS": "1"})
        acc[name] = read_jsonl(tmp_path / name / "metrics.jsonl")[-1]["val_acc"]
    print(f"val_acc after 4 epochs: {acc}")
    assert abs(acc["auto"] - acc["pil"]) <= 0.03 and acc["pil"] - acc["scrambled"] >= 0.5, acc
{% else %}
def test_image_files_give_what_image_folder_gives(tmp_path):
    """A JPEG in colour, one in grayscale and a PNG come out of ImageFiles as out of torchvision's ImageFolder with
    the same transform: PIL's decode and convert("RGB"), then the transform. Negative control: the grayscale file,
    as PIL opens it, has one channel, not three."""
    (tmp_path / "a").mkdir()
    gen = np.random.default_rng(0)
    pixels = gen.integers(0, 256, (48, 64, 3), dtype=np.uint8)
    Image.fromarray(pixels, "RGB").save(tmp_path / "a" / "0.jpg", quality=90)
    Image.fromarray(pixels, "RGB").convert("L").save(tmp_path / "a" / "1.jpg", quality=90)
    Image.fromarray(pixels, "RGB").save(tmp_path / "a" / "2.png")
    transform = v2.Compose([v2.ToImage(), v2.Resize(24, antialias=True), v2.CenterCrop(24)])
    ours, theirs = ImageFiles(tmp_path, transform), datasets.ImageFolder(str(tmp_path), transform=transform)
    for i in range(3):
        assert torch.equal(ours[i][0], theirs[i][0]) and ours[i][1] == theirs[i][1] == 0
        assert ours[i][0].shape == (3, 24, 24)
    assert np.asarray(Image.open(tmp_path / "a" / "1.jpg")).ndim == 2
{% endif %}
{% if cookiecutter.with_streams == "no" %}


class Records(torch.utils.data.IterableDataset):
    """A data set read in order (it takes whatever arguments the data config gives it)."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs

    def __iter__(self):
        return iter([(torch.zeros(3, 8, 8, dtype=torch.uint8), 0)] * 4)


def test_a_data_set_read_in_order_is_refused_in_one_line(tmp_path):
    """The project was generated without streams (with_streams=no): an IterableDataset in data.train is one `error:`
    line from train.py, before any run folder is made, not a DataLoader's traceback mid-build."""
    shapes = [f"data.root={tmp_path / 's'}", "data.per_class=2", "data.image_size=8"]
    proc = run_train(tmp_path / "run", *shapes, "data.train._target_=tests.test_data.Records", expect=2)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: data.train: Records is an IterableDataset"), proc.stderr
    assert "streams are not part of this project" in lines[0]
    assert not (tmp_path / "run").exists()
    # the check refuses a data set read in order, not any data set that is not the project's own
    assert parts.data_set(OmegaConf.create({"val": {"_target_": "builtins.list"}}), "val") == []
    with pytest.raises(UserError, match=r"^data.val: Records is an IterableDataset"):
        parts.data_set(OmegaConf.create({"val": {"_target_": "tests.test_data.Records"}}), "val")
{% endif %}
