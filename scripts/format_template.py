"""Apply ruff's fixes and formatting to the template's Python files.

The template's .py files hold Jinja (`{{ cookiecutter.package }}`), which ruff cannot parse, so this bakes
the template with the default answers, runs `ruff check --fix` and `ruff format` on the bake (with the
baked project's own [tool.ruff] settings), and writes each changed file back with the package name and
description turned back into their Jinja fields. A file holding any other Jinja is left alone and named.

    python scripts/format_template.py          # or: make format
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from cookiecutter.main import cookiecutter

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "{{cookiecutter.project}}"
FIELDS = ("package", "description")  # the Jinja fields .py files may hold, written back from the bake


def main() -> int:
    defaults = json.loads((ROOT / "cookiecutter.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        project = Path(cookiecutter(str(ROOT), no_input=True, output_dir=tmp))
        package = project.name.replace("-", "_").lower()
        answers = {"package": package, "description": defaults["description"]}
        ruff = [sys.executable, "-m", "ruff"]
        subprocess.run([*ruff, "check", "--fix", "--no-cache", "-q", "."], cwd=project)  # what it cannot fix it prints
        subprocess.run([*ruff, "format", "--no-cache", "-q", "."], cwd=project, check=True)
        changed, skipped = [], []
        for baked in sorted(project.rglob("*.py")):
            rel = baked.relative_to(project)
            source = TEMPLATE / Path(*[("{{cookiecutter.package}}" if part == package else part) for part in rel.parts])
            original = source.read_text()
            rendered = original
            for field in FIELDS:
                rendered = rendered.replace("{{ cookiecutter.%s }}" % field, answers[field])
            if "{{" in rendered or "{%" in rendered or package in original:
                skipped.append(str(rel))
                continue
            text = baked.read_text()
            for field in FIELDS:
                text = text.replace(answers[field], "{{ cookiecutter.%s }}" % field)
            if text != original:
                source.write_text(text)
                changed.append(str(rel))
    print("formatted:", ", ".join(changed) or "nothing to change")
    if skipped:
        print("left alone (other Jinja, format by hand):", ", ".join(skipped))
    return 0


if __name__ == "__main__":
    sys.exit(main())
