"""Answers that would make a broken project are refused in one line, leaving nothing behind (local_extensions.py)."""
import re
import subprocess
import sys

import local_extensions
import pytest
from cookiecutter.exceptions import FailedHookException

REFUSED = [
    {"project": "bad name!"},
    {"project": "-lead"},
    {"package": "class"},   # keyword
    {"package": "torch"},   # shadows a dependency
    {"package": "json"},    # shadows the stdlib
    {"package": "Json"},    # shadows it too on case-insensitive file systems
    {"package": "2fast"},   # not an identifier
    {"package": "my-pkg"},  # not an identifier
    {"package": "benchmarks"},  # a folder of the project
    {"with_tracking": "maybe"},  # an optional part is yes or no
    {"with_slurm": "true"},
]


@pytest.mark.parametrize("answers", REFUSED, ids=lambda a: "=".join(*a.items()))
def test_refused(bake, tmp_path, answers):
    with pytest.raises(FailedHookException) as refused:
        bake(tmp_path, **answers)
    assert list(tmp_path.iterdir()) == []  # checked while the answers are rendered: nothing was created
    (name, value), = answers.items()
    message = str(refused.value)
    assert message.startswith(f"ERROR: {name} {value!r}") and "\n" not in message, message


def cli(template_dir, cookiecutter_config, tmp_path, *answers):
    return subprocess.run(
        [sys.executable, "-m", "cookiecutter", str(template_dir), "--no-input",
         "--config-file", str(cookiecutter_config), "-o", str(tmp_path), *answers],
        capture_output=True, text=True, timeout=120,
    )


@pytest.mark.parametrize("answer", ["project=bad name!", "package=json", "package=2fast"])
def test_refused_via_cli_is_one_line_without_traceback(template_dir, cookiecutter_config, tmp_path, answer):
    proc = cli(template_dir, cookiecutter_config, tmp_path, answer)
    output = (proc.stdout + proc.stderr).strip()
    assert proc.returncode != 0, output
    assert len(output.splitlines()) == 1 and output.startswith("ERROR: ") and "Traceback" not in output, output
    assert not tmp_path.exists() or list(tmp_path.iterdir()) == []


def test_a_project_name_whose_package_is_invalid_says_how_to_pass_one(template_dir, cookiecutter_config, tmp_path):
    proc = cli(template_dir, cookiecutter_config, tmp_path, "project=123lab")
    assert proc.returncode != 0
    assert ("ERROR: package '123lab', the import name derived from project '123lab', is not a Python identifier"
            in proc.stdout), proc.stdout + proc.stderr
    suggested = re.search(r"project=123lab (package=\w+)$", proc.stdout.strip())[1]
    proc = cli(template_dir, cookiecutter_config, tmp_path, "project=123lab", suggested)
    assert proc.returncode == 0 and (tmp_path / "123lab" / suggested.split("=")[1]).is_dir()


def test_readme_lists_the_names_the_check_reserves(template_dir):
    readme = (template_dir / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `package`"))
    listed = set(re.findall(r"`([^`]+)`", row.split("not a name the project imports or holds", 1)[1]))
    assert listed == local_extensions.TAKEN
