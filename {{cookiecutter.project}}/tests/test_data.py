"""The shapes data set (data.py): the same files for a given recipe, and a folder it did not draw is refused."""

import json

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from {{ cookiecutter.package }}.data import SHAPES, ImageFiles, make_shapes, shapes
from {{ cookiecutter.package }}.engine import checks, schema
from {{ cookiecutter.package }}.engine.errors import UserError
from tests.helpers import PROJECT


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
    with pytest.raises(UserError, match="not a generated shapes folder"):
        make_shapes(tmp_path / "mine", per_class=3, image_size=16, data_seed=1)


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
    """The part of a run's config that checks.precheck_data reads, for data=shapes in `root`."""
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
    checks.precheck_data(shapes_config(tmp_path / "one", per_class=2))
    with pytest.raises(UserError, match="drawn with other settings"):
        checks.precheck_data(shapes_config(tmp_path / "one", per_class=3))
