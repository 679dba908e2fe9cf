"""Answers the pre_gen_project hook must refuse, leaving nothing generated behind."""
import subprocess
import sys

import pytest
from cookiecutter.exceptions import FailedHookException

REFUSED = [
    {"project": "bad name!"},
    {"project": "-lead"},
    {"package": "class"},   # keyword
    {"package": "torch"},   # shadows a dependency
    {"package": "json"},    # shadows the stdlib
    {"package": "2fast"},   # not an identifier
    {"package": "my-pkg"},  # not an identifier
]


@pytest.mark.parametrize("answers", REFUSED, ids=lambda a: "=".join(*a.items()))
def test_refused(bake, tmp_path, answers, capfd):
    with pytest.raises(FailedHookException):
        bake(tmp_path, **answers)
    # Cookiecutter creates the project dir before the pre hook and must remove it.
    assert list(tmp_path.iterdir()) == []
    err = capfd.readouterr().err
    # Exactly one line from the hook naming the refused answer (cookiecutter may log more).
    (name, value), = answers.items()
    errors = [line for line in err.splitlines() if line.startswith(f"ERROR: {name} ")]
    assert len(errors) == 1 and repr(value) in errors[0], err


def test_refused_via_cli(template_dir, cookiecutter_config, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "cookiecutter", str(template_dir), "--no-input",
         "--config-file", str(cookiecutter_config), "-o", str(tmp_path), "project=bad name!"],
        capture_output=True, text=True, timeout=120,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert "ERROR: project 'bad name!' is not a valid directory/distribution name" in output
    assert list(tmp_path.iterdir()) == []
