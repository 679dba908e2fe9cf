"""Bake the template and check what comes out: files, names, no leftover Jinja."""
import ast
import re
import subprocess
import sys
from datetime import datetime, timezone

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: requirements-dev.txt brings tomli there
    import tomli as tomllib

NON_DEFAULT = {"project": "vision-lab", "package": "vlab", "license": "none", "author": "Ada"}
MINIMAL = {"with_tracking": "no", "with_shards": "no", "with_streams": "no", "with_slurm": "no",
           "with_benchmarks": "no", "with_fsdp": "no", "with_photos": "no", "with_doctor": "no"}  # fmt: skip
NEWEST_PYTHON = "3.14"  # the newest CPython release; raise it when a new one comes out


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


@pytest.mark.parametrize("answers", [{}, NON_DEFAULT, MINIMAL], ids=["defaults", "non-default", "minimal"])
def test_fully_rendered(bake, tmp_path, answers):
    project = bake(tmp_path, **answers)
    for path in project.rglob("*"):
        assert "{{" not in path.name and "{%" not in path.name, path
    for path, text in text_files(project):
        rel = path.relative_to(project)
        if rel.parts[:2] == (".github", "workflows"):  # GitHub's own `${{ matrix.x }}` expressions are meant to stay
            text = re.sub(r"\$\{\{ [\w.-]+ \}\}", "", text)
        assert "{{" not in text, f"unrendered '{{{{' in {rel}"
        assert "{%" not in text, f"unrendered '{{%' in {rel}"
        if path.suffix == ".py":
            ast.parse(text, filename=str(rel))


@pytest.mark.parametrize("answers", [{}, NON_DEFAULT], ids=["defaults", "non-default"])
@pytest.mark.parametrize("command", [["check", "."], ["format", "--check", "."]], ids=["check", "format"])
def test_ruff_clean_as_generated(bake, tmp_path, answers, command):
    """The baked project passes its own lint and format settings ([tool.ruff] in its pyproject.toml), as its CI runs them."""
    project = bake(tmp_path, **answers)
    proc = subprocess.run([sys.executable, "-m", "ruff", *command, "--no-cache"], cwd=project, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, f"ruff {' '.join(command)} in {project}:\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}"


def test_ci_and_hooks_are_there(bake, tmp_path):
    project = bake(tmp_path)
    ci = (project / ".github/workflows/ci.yml").read_text()
    workflow = yaml.safe_load(ci)
    assert {"push", "pull_request"} <= set(workflow[True])  # YAML 1.1 reads the key `on` as True
    assert "download.pytorch.org/whl/cpu" in ci and 'pytest -m "not slow"' in ci
    assert "ruff check" in ci and "ruff format --check" in ci
    hooks = (project / ".pre-commit-config.yaml").read_text()
    assert yaml.safe_load(hooks)["repos"]
    assert all(h in hooks for h in ("ruff-check", "ruff-format", "trailing-whitespace", "end-of-file-fixer", "check-yaml"))


def test_ci_runs_the_python_range_and_the_newest_dependencies(bake, tmp_path):
    """The matrix holds the oldest and the newest Python that requires-python admits; a scheduled job installs the
    newest versions the dependency ranges allow."""
    project = bake(tmp_path)
    workflow = yaml.safe_load((project / ".github/workflows/ci.yml").read_text())
    requires = project_table(project)["requires-python"]
    admitted = [v for v in ("3.9", "3.10", "3.11", "3.12", "3.13", "3.14") if Version(v) in SpecifierSet(requires)]
    assert workflow["jobs"]["test"]["strategy"]["matrix"]["python-version"] == [admitted[0], NEWEST_PYTHON]
    assert workflow[True]["schedule"] and "schedule" in workflow["jobs"]["newest"]["if"]
    newest = workflow["jobs"]["newest"]
    assert newest["steps"][1]["with"]["python-version"] == NEWEST_PYTHON
    install = next(step["run"] for step in newest["steps"] if "pip install" in step.get("run", ""))
    assert "--upgrade --upgrade-strategy eager" in install and ".[dev]" in install


@pytest.mark.parametrize("answers", [{}, MINIMAL], ids=["defaults", "minimal"])
def test_ci_installs_the_lower_bounds(bake, tmp_path, answers):
    """On every push a `lowest` job pins each `>=` bound of pyproject.toml's [project] tables, dependencies and
    extras alike (its constraints file, made by the script in the workflow, run here on the baked file), on the
    oldest Python requires-python admits, and runs the fast tier."""
    project = bake(tmp_path, **answers)
    workflow = yaml.safe_load((project / ".github/workflows/ci.yml").read_text())
    lowest = workflow["jobs"]["lowest"]
    assert "push" in lowest["if"] and "pull_request" in lowest["if"]
    requires = project_table(project)["requires-python"]
    admitted = [v for v in ("3.9", "3.10", "3.11", "3.12", "3.13", "3.14") if Version(v) in SpecifierSet(requires)]
    assert lowest["steps"][1]["with"]["python-version"] == admitted[0]
    install = next(step["run"] for step in lowest["steps"] if "floors.txt" in step.get("run", ""))
    assert '-e ".[dev]" -c floors.txt' in install and "download.pytorch.org/whl/cpu" in install
    assert any('pytest -m "not slow"' in step.get("run", "") for step in lowest["steps"])
    script = re.search(r"<<'EOF'\n(.*?)\nEOF\n", install, re.S).group(1)
    proc = subprocess.run([sys.executable, "-c", script], cwd=project, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    pinned = dict(line.split("==") for line in proc.stdout.split())
    table = project_table(project)
    declared = [Requirement(r) for r in table["dependencies"]]
    declared += [Requirement(r) for reqs in table["optional-dependencies"].values() for r in reqs]
    floors = {r.name: s.version for r in declared for s in r.specifier if s.operator == ">="}
    assert pinned == floors
    assert {"torch", "torchvision", "numpy", "pytest", "ruff"} <= set(pinned) and "setuptools" not in pinned


def requirement_lines(path) -> list[str]:
    """The requirements of a pip requirements file, comments dropped, with those of the files it includes
    (`-r other.txt`, as requirements-dev.txt includes requirements-demo.txt); other options are skipped."""
    lines = []
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        include = re.fullmatch(r"(?:-r|--requirement)[ =]?\s*(\S+)", line)
        if include:
            lines += requirement_lines(path.parent / include.group(1))
        elif line and not line.startswith("-"):
            lines.append(line)
    return lines


def project_table(project) -> dict:
    return tomllib.loads((project / "pyproject.toml").read_text())["project"]


def test_dependency_ranges_hold_what_the_tests_run_on(bake, template_dir, tmp_path):
    """Every library the project or its tests import has an upper bound; the versions this repository's tests run
    on (the pins of requirements-dev.txt and the requirements-demo.txt it includes) are inside those ranges;
    requirements.txt repeats the project's own."""
    table = project_table(bake(tmp_path))
    declared = [Requirement(r) for r in table["dependencies"]]
    declared += [Requirement(r) for reqs in table["optional-dependencies"].values() for r in reqs]
    tools = {"pre-commit"}  # run by hand, not imported by the project or its tests
    unbounded = [str(r) for r in declared if r.name not in tools and not any(s.operator == "<" for s in r.specifier)]
    assert not unbounded, f"no upper bound: {unbounded}"
    ranges = {r.name: r.specifier for r in declared}
    checked = set()
    for pin in requirement_lines(template_dir / "requirements-dev.txt"):
        req = Requirement(pin)
        for version in (s.version for s in req.specifier if s.operator == "=="):
            if req.name in ranges:
                declared_range = f"{req.name}{ranges[req.name]}"
                assert version in ranges[req.name], f"the tests run {pin}, outside the declared {declared_range}"
                checked.add(req.name)
    assert {"torch", "torchvision", "hydra-core", "omegaconf"} <= checked, f"pins read from -r includes: {checked}"
    listed = (tmp_path / "my-trainer/requirements.txt").read_text().splitlines()
    assert set(table["dependencies"]) <= set(listed), "requirements.txt and pyproject.toml differ"


def test_readme_generate_command_works_from_a_clone(template_dir, cookiecutter_config, tmp_path):
    """`cookiecutter . --no-input` as the README writes it, run in the repository root."""
    readme = (template_dir / "README.md").read_text()
    assert "cookiecutter . --no-input" in readme
    proc = subprocess.run(
        [sys.executable, "-m", "cookiecutter", ".", "--no-input", "-o", str(tmp_path),
         "--config-file", str(cookiecutter_config)],
        cwd=template_dir, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "my-trainer" / "train.py").is_file() and (tmp_path / "my-trainer" / "eval.py").is_file()


@pytest.mark.parametrize("answers", [{}, MINIMAL], ids=["defaults", "minimal"])
def test_hygiene_hooks_would_change_nothing(bake, tmp_path, answers):
    """What the pre-commit hygiene hooks fix (trailing whitespace, missing or extra final newlines) is not there."""
    project = bake(tmp_path, **answers)
    for path, text in text_files(project):
        rel = path.relative_to(project)
        assert not any(line != line.rstrip() for line in text.splitlines()), f"trailing whitespace in {rel}"
        assert not text or (text.endswith("\n") and not text.endswith("\n\n")), f"final newline in {rel}"
