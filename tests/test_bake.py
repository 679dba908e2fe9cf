"""Bake the template and check what comes out: files, names, no leftover Jinja."""
import ast
from datetime import datetime, timezone

import pytest

NON_DEFAULT = {"project": "vision-lab", "package": "vlab", "license": "none", "author": "Ada"}


def text_files(project):
    """(path, text) for every file that decodes as UTF-8 text; binary files are skipped."""
    for path in sorted(project.rglob("*")):
        if not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue
        try:
            yield path, data.decode("utf-8")
        except UnicodeDecodeError:
            continue


def test_defaults(bake, tmp_path):
    project = bake(tmp_path)
    assert project == tmp_path / "my-trainer"
    for rel in ["train.py", "conf/config.yaml", "my_trainer/__init__.py",
                "pyproject.toml", "README.md", "LICENSE"]:
        assert (project / rel).is_file(), f"missing {rel}"
    text = (project / "LICENSE").read_text()
    assert "MIT License" in text and f"Copyright (c) {bake_year()} Your Name" in text


def bake_year() -> int:
    """The year the bake ran in (UTC), as the LICENSE states it; a bake across New Year's Eve may show either."""
    return datetime.now(timezone.utc).year


def test_non_default_answers(bake, tmp_path):
    project = bake(tmp_path, **NON_DEFAULT)
    assert project == tmp_path / "vision-lab"
    assert (project / "vlab" / "__init__.py").is_file()
    assert not (project / "my_trainer").exists()
    assert not (project / "LICENSE").exists()
    assert "Ada" in (project / "pyproject.toml").read_text()


@pytest.mark.parametrize("license_", ["Apache-2.0", "BSD-3-Clause"])
def test_other_licenses(bake, tmp_path, license_):
    before = bake_year()
    text = (bake(tmp_path, license=license_, author="Ada") / "LICENSE").read_text()
    years = {before, bake_year()}
    assert any(f"Copyright {y} Ada" in text or f"Copyright (c) {y}, Ada" in text for y in years), text[:300]
    assert text.startswith(tuple(f"Copyright {y} Ada" for y in years) + ("BSD 3-Clause License",))


@pytest.mark.parametrize("answers", [{}, NON_DEFAULT], ids=["defaults", "non-default"])
def test_fully_rendered(bake, tmp_path, answers):
    project = bake(tmp_path, **answers)
    for path in project.rglob("*"):
        assert "{{" not in path.name and "{%" not in path.name, path
    for path, text in text_files(project):
        rel = path.relative_to(project)
        assert "{{" not in text, f"unrendered '{{{{' in {rel}"
        assert "{%" not in text, f"unrendered '{{%' in {rel}"
        if path.suffix == ".py":
            ast.parse(text, filename=str(rel))
