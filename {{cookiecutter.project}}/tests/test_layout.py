"""The README's Layout section is the package as it is: every module listed, nothing listed that is not there, and
each engine module importing only the engine modules listed below it (or beside it: none at all)."""

import ast
import re

from tests.helpers import PROJECT

PACKAGE = "{{ cookiecutter.package }}"


def layout() -> tuple[list[str], list[str]]:
    """(the package's top-level modules, the engine's modules in their listed order), as the README lists them."""
    readme = (PROJECT / "README.md").read_text()
    block = readme.split("## Layout", 1)[1].split("```", 2)[1]
    top = re.findall(rf"^{PACKAGE}/(\w+\.py)\s", block, flags=re.M)
    engine = re.findall(r"^  (\w+\.py)\s", block, flags=re.M)
    return top, engine


def engine_imports(module: str) -> set[str]:
    """The engine modules `module` imports (`from . import x`, `from .x import y`)."""
    tree = ast.parse((PROJECT / PACKAGE / "engine" / module).read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names = [node.module] if node.module else [a.name for a in node.names]
            found.update(f"{name}.py" for name in names)
    return found


def misfits(top: list[str], engine: list[str]) -> list[str]:
    """What the listing gets wrong about the files, one line each; [] when it is right."""
    files = {p.name for p in (PROJECT / PACKAGE).glob("*.py")} - {"__init__.py"}
    engine_files = {p.name for p in (PROJECT / PACKAGE / "engine").glob("*.py")} - {"__init__.py"}
    wrong = [f"{PACKAGE}/{name} is not listed" for name in sorted(files - set(top))]
    wrong += [f"{PACKAGE}/{name} is listed but not there" for name in sorted(set(top) - files)]
    wrong += [f"engine/{name} is not listed" for name in sorted(engine_files - set(engine))]
    wrong += [f"engine/{name} is listed but not there" for name in sorted(set(engine) - engine_files)]
    for i, module in enumerate(engine):
        if module in engine_files:
            above = sorted(engine_imports(module) & set(engine[:i]))
            wrong += [f"engine/{module} imports {name}, listed above it" for name in above]
    return wrong


def test_the_layout_lists_every_module_in_import_order():
    assert misfits(*layout()) == []


def test_the_layout_check_can_fail():
    """Negative controls: a module left out, one that is not there, and two engine modules in the wrong order."""
    top, engine = layout()
    assert misfits(top[1:], engine) == [f"{PACKAGE}/{top[0]} is not listed"]
    assert misfits(top, [*engine, "gone.py"]) == ["engine/gone.py is listed but not there"]
    swapped = list(engine)
    i, j = swapped.index("run.py"), swapped.index("loader.py")
    swapped[i], swapped[j] = swapped[j], swapped[i]
    assert "engine/run.py imports loader.py, listed above it" in misfits(top, swapped)


def engine_used(source: str) -> set[str]:
    """The engine modules a module of the package imports (`from .engine.x import y`, `from .engine import x`)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and (node.module or "").startswith("engine"):
            found.update([node.module.split(".")[1]] if "." in node.module else [a.name for a in node.names])
    return found


def test_the_users_files_use_only_the_engines_public_surface():
    """data.py, callbacks.py and the other top-level files import only the engine modules the package docstring
    names as its public surface."""
    public = set(re.findall(r"`engine\.(\w+)`", (PROJECT / PACKAGE / "__init__.py").read_text()))
    tools = ("__init__.py", "export.py"{% if cookiecutter.with_doctor == "yes" %}, "doctor.py"{% endif %})  # commands, not the user's code
    users = [p for p in (PROJECT / PACKAGE).glob("*.py") if p.name not in tools]
    assert {"data.py", "callbacks.py"} <= {p.name for p in users} and "errors" in public
    used = {p.name: engine_used(p.read_text()) - public for p in users}
    assert {name: modules for name, modules in used.items() if modules} == {}
    assert engine_used("from .engine.dry_step import first_samples\n") - public == {"dry_step"}  # the control
