"""Fixtures shared by the test files; plain helper functions live in tests/helpers.py."""

from pathlib import Path

import pytest

from tests.helpers import run_train


def shapes_overrides(root: Path) -> list[str]:
    """Two epochs of 5 steps (160 training images of 4 classes, batch 32) on a shapes folder at `root`."""
    return [f"data.root={root}", "data.per_class=40", "epochs=2", "loader.batch_size=32", "progress=false"]


@pytest.fixture(scope="session")
def shapes_root(tmp_path_factory) -> Path:
    """A small shapes folder shared by the tests that train on real image files."""
    return tmp_path_factory.mktemp("data") / "shapes"


@pytest.fixture
def shapes(shapes_root) -> list[str]:
    return shapes_overrides(shapes_root)


@pytest.fixture(scope="session")
def shapes_run(tmp_path_factory, shapes_root) -> Path:
    """`python train.py` with the `shapes` overrides and nothing else (the default loader profile, balanced, and the
    default callbacks), trained once for every test that only reads such a run: checkpoints after each epoch (step 5
    and step 10). The run is the only one in its parent folder (a `checkpoint.search_dir` of its own); a test that
    writes into a run or beside it copies this one first."""
    run_dir = tmp_path_factory.mktemp("shapes_run") / "run"
    run_train(run_dir, *shapes_overrides(shapes_root))
    return run_dir
