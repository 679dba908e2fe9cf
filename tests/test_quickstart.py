"""The generated README's Quick start, run as a new user runs it: each line of its first code block, in the order
written, in a fresh bake, with the default run folders (`outputs/<date>/<time>_...`), pasted into a shell.

The pip lines are left out: the commands run with this repository's .venv first on PATH, which holds what they
install. Every command must exit 0 without a Python warning; `tensorboard`, which serves until stopped, must serve
the runs the lines before it wrote and stop on Ctrl-C (SIGINT) with exit code 0.
"""

import os
import re
import select
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

# How Python's warnings module prints one: `path:line: SomeWarning: message`.
PYTHON_WARNING = re.compile(r"^\S.*:\d+: \w*Warning: ", re.MULTILINE)


def quick_start(readme: str) -> list[str]:
    """The lines of the first ```bash block after the `## Quick start` heading."""
    section = readme.split("\n## Quick start\n", 1)[1]
    block = section.split("```bash\n", 1)[1].split("\n```", 1)[0]
    return [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def user_env() -> dict:
    """The environment of a user whose virtual environment is active: its bin/ first on PATH, no warning filters."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONWARNINGS", "PYTEST_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def no_python_warning(line: str, output: str) -> None:
    found = PYTHON_WARNING.findall(output)
    assert not found and "Traceback" not in output, f"{line!r} printed a warning or a traceback:\n{output[-4000:]}"


def serve_and_stop(line: str, cwd: Path, env: dict) -> str:
    """Run a server line (tensorboard), wait for the address it prints, read it, then Ctrl-C it: its output."""
    proc = subprocess.Popen(
        ["bash", "-c", line],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # Ctrl-C goes to the whole group, as a terminal sends it
        # and finds SIGINT handled, as in a terminal: a CI runner that starts jobs with `&` (or nohup) hands its
        # children SIGINT ignored, which Python keeps, and TensorBoard then serves on after Ctrl-C
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # noqa: PLW1509
    )
    output, deadline = "", time.monotonic() + 120
    try:
        while not re.search(r"http://\S+/\s", output):  # the whole address, not the first part of a read
            left = deadline - time.monotonic()
            assert left > 0 and proc.poll() is None, f"{line!r} serves nothing:\n{output}"
            if select.select([proc.stdout], [], [], left)[0]:  # output to read, or the deadline
                output += os.read(proc.stdout.fileno(), 1 << 16).decode(errors="replace")
        url = re.search(r"http://\S+/(?=\s)", output)[0]
        with urllib.request.urlopen(url + "data/runs", timeout=30) as page:  # the run list TensorBoard shows
            runs = page.read().decode()
        os.killpg(proc.pid, signal.SIGINT)
        try:
            output += proc.communicate(timeout=30)[0].decode(errors="replace")
        except subprocess.TimeoutExpired:  # its threads, for whoever reads the failure
            spy = [str(Path(sys.executable).parent / "py-spy"), "dump", "--pid", str(proc.pid)]
            stacks = subprocess.run(spy, check=False, capture_output=True, text=True, timeout=60)
            pytest.fail(f"{line!r} did not stop within 30 s of Ctrl-C; its threads:\n{stacks.stdout}{stacks.stderr}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, f"{line!r} exited {proc.returncode} on Ctrl-C:\n{output[-3000:]}"
    return runs + "\n" + output


@pytest.mark.slow
def test_quick_start_runs_as_written(bake, tmp_path):
    project = bake(tmp_path)
    lines = [line for line in quick_start((project / "README.md").read_text()) if not line.startswith("pip ")]
    assert [line.split()[0] for line in lines] == ["python"] * (len(lines) - 1) + ["tensorboard"], lines
    env, seconds = user_env(), {}
    for line in lines:
        started = time.monotonic()
        if line.startswith("tensorboard"):
            output = serve_and_stop(line, project, env)
            assert output.count("_train_") >= 3, output  # the three training runs are there to look at
        else:
            proc = subprocess.run(
                ["bash", "-c", line], cwd=project, env=env, capture_output=True, text=True, timeout=900, check=False
            )
            output = proc.stdout + proc.stderr
            assert proc.returncode == 0, f"{line!r} exited {proc.returncode}:\n{output[-4000:]}"
        no_python_warning(line, output)
        seconds[line.split("#")[0].strip()] = round(time.monotonic() - started)
    runs = sorted(p.name.split("_", 1)[1] for p in (project / "outputs").glob("*/*"))
    assert runs == [
        "doctor_balanced",
        "eval_balanced",
        "train_auto",
        "train_balanced",
        "train_memory-tight",
        "train_memory-tight_debug",
    ], runs
    print(f"Quick start, seconds per line: {seconds}")


def test_quick_start_is_found_and_the_warning_check_can_fail():
    """The parsing above, and a negative control for the warning check (Hydra's own format of the old warning)."""
    readme = "# x\n\n## Quick start\n\n```bash\npip install -e .\npython train.py   # note\n\ntensorboard\n```\n"
    assert quick_start(readme) == ["pip install -e .", "python train.py   # note", "tensorboard"]
    hydra = (
        "/x/hydra/_internal/callbacks.py:28: UserWarning: Callback RunFolder.on_run_start raised "
        "InterpolationResolutionError: ...\n  warnings.warn(\n"
    )
    with pytest.raises(AssertionError, match="printed a warning"):
        no_python_warning("python train.py", "[INFO] - epoch 0\n" + hydra)
    no_python_warning("python train.py", "[2026-12-01 10:00:00,000][loader][WARNING] - a log line, not a Python one")
