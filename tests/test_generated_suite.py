"""Run the generated project's own test suite, for default and non-default answers."""
import os
import subprocess
import sys

import pytest

NON_DEFAULT = {"project": "vision-lab", "package": "vlab", "license": "none", "author": "Ada"}


# The whole suite once (defaults); with other answers, the parts that import the renamed package
# and train with it, which is what the answers change, without re-running every resume case.
QUICK = ["tests/test_config.py", "tests/test_loader.py", "tests/test_train.py"]


@pytest.mark.slow
@pytest.mark.parametrize("answers, paths", [({}, []), (NON_DEFAULT, QUICK)], ids=["defaults", "non-default"])
def test_generated_suite_passes(bake, tmp_path, answers, paths):
    project = bake(tmp_path, **answers)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *paths],
        cwd=project, env=dict(os.environ), capture_output=True, text=True, timeout=1200,
    )
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
    assert proc.returncode == 0, f"generated suite failed in {project}:\n{tail}"
