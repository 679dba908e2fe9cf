"""Fixtures shared by the test files; plain helper functions live in tests/helpers.py."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def shapes_root(tmp_path_factory) -> Path:
    """A small shapes folder shared by the tests that train on real image files."""
    return tmp_path_factory.mktemp("data") / "shapes"


@pytest.fixture
def shapes(shapes_root) -> list[str]:
    return [f"data.root={shapes_root}", "data.per_class=40", "epochs=2", "loader.batch_size=32", "progress=false"]
