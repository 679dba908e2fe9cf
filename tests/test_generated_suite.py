"""Run the generated project's own test suite, for default and non-default answers.

`make test` runs the fast tier (`pytest -m "not slow"` in the baked project, minutes); `make test-all` adds the
generated slow tier once, for the default answers. Each run is `pytest -v` into a log file, so a run that
times out names the generated test it was in, not a line of dots.
"""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

NON_DEFAULT = {"project": "vision-lab", "package": "vlab", "license": "none", "author": "Ada"}
# Every optional part left out (cookiecutter.json's with_*): the smallest project. Its fast tier where the answers
# change code: the tests of the modules with a part's {% if %} blocks (checkpoint, checks, schema, preflight,
# distributed, failures, resume, run, runlog, data, train.py; loader, eval.py, rng, schedule: with_streams;
# eval.py and export: with_fsdp; data, device, memory: with_photos), of the README's layout and of its
# links into docs/; the other modules
# are the same text in every bake, or lose only a part's own branch (tests/test_parts.py checks each bake is
# ruff-clean and trains). The doctor is left out here too (with_doctor), so its own with_streams and with_fsdp
# branches are not run in this bake: tests/test_parts.py's single-`no` bakes check they are ruff-clean.
MINIMAL = {"with_tracking": "no", "with_shards": "no", "with_streams": "no", "with_slurm": "no",
           "with_benchmarks": "no", "with_fsdp": "no", "with_photos": "no", "with_doctor": "no"}  # fmt: skip
WHERE_PARTS_CHANGE_CODE = [
    f"tests/test_{name}.py"
    for name in ("checkpoint", "config", "distributed", "bad_sample", "stall", "shm", "resume", "train", "runlog",
                 "data", "host_reads", "task_results", "layout", "docs", "loader", "eval", "rng", "schedule",
                 "device", "memory")
]  # fmt: skip

# With other answers, the parts that import the renamed package and train with it, which is what the answers change.
QUICK = ["tests/test_config.py", "tests/test_loader.py", "tests/test_train.py"]

# A result pytest -v writes after a test's node id once it finishes; a node id line without one is still running.
RESULT = re.compile(r"\b(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def running_test(log: str) -> str:
    """The generated test pytest -v had started but not finished when the log ends."""
    started = [line for line in log.splitlines() if line.startswith("tests/") and "::" in line]
    if started and not RESULT.search(started[-1]):
        return started[-1].split()[0]
    return "none running (between tests or in collection/teardown)"


def run_generated(project, log_path, *args, timeout, env=None):
    """`pytest -v ARGS` in the baked project (`env`: variables on top of this one's); on timeout the whole process
    group goes and the test is named."""
    cmd = [sys.executable, "-m", "pytest", "-v", "-rA", "-p", "no:cacheprovider", *args]
    started = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=project, env={**os.environ, **(env or {})}, stdout=log,
                                stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own group: train.py and loader workers go with it
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            text = log_path.read_text()
            pytest.fail(f"generated suite timed out after {timeout} s in {running_test(text)}\n"
                        f"full log: {log_path}\n" + "\n".join(text.splitlines()[-30:]))
    text = log_path.read_text()
    tail = "\n".join(text.splitlines()[-60:])
    assert code == 0, f"generated suite failed ({' '.join(args)}) in {project}, log {log_path}:\n{tail}"
    return text, time.monotonic() - started


# Both tiers on two pytest workers (pytest-xdist): most of a generated test's time goes to train.py subprocesses
# starting up and waiting on their loader workers, so two at a time fill two cores. A hung test fails by name through
# pytest-timeout (PER_TEST_S each; xdist reports the test its worker was running).
WORKERS, PER_TEST_S = 2, 900


# make test runs the template's tests on two xdist workers, with --dist loadgroup: the three fast tiers (each on two
# workers of its own) share one group, so they run one after the other while the bakes and checks run beside them.
@pytest.mark.xdist_group("generated-fast-tier")
@pytest.mark.parametrize(
    "answers, paths",
    [({}, []), (NON_DEFAULT, QUICK), (MINIMAL, WHERE_PARTS_CHANGE_CODE)],
    ids=["defaults", "non-default", "minimal"],
)
def test_generated_fast_tier_passes(bake, tmp_path, answers, paths):
    project = bake(tmp_path, **answers)
    workers = ["-n", str(WORKERS), f"--timeout={PER_TEST_S}", "--timeout-method=thread"]
    text, seconds = run_generated(project, tmp_path / "fast.log", "-m", "not slow", *workers, *paths, timeout=900)
    assert " passed" in text.splitlines()[-1], text.splitlines()[-1]
    print(f"generated fast tier ({answers or 'defaults'}): {seconds:.0f} s")


@pytest.mark.slow
def test_generated_slow_tier_passes(bake, tmp_path):
    project = bake(tmp_path)
    args = ["-m", "slow", "-n", str(WORKERS), f"--timeout={PER_TEST_S}", "--timeout-method=thread", "--durations=25"]
    # One intra-op thread per process: two pytest workers each run several train.py processes (torchrun ranks, their
    # loader workers) on two cores, where more threads only wait on each other. The fast tier keeps torch's default.
    text, seconds = run_generated(project, tmp_path / "slow.log", *args, timeout=3600, env={"OMP_NUM_THREADS": "1"})
    assert " passed" in text.splitlines()[-1], text.splitlines()[-1]
    print(f"generated slow tier: {seconds:.0f} s")
    durations = text[text.find("slowest 25 durations"):].split("\n", 1)[-1]  # the lines under that heading
    print(durations[:durations.find("=====")])  # where CI's time goes


def test_under_xdist_a_hung_test_is_named_by_its_own_timeout(tmp_path):
    """What the slow tier relies on: with -n 2, pytest-timeout fails the hung test by name and the run goes on."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests/test_hang.py").write_text(
        "import time\n\ndef test_quick():\n    pass\n\ndef test_stuck():\n    time.sleep(600)\n"
    )
    # pytest-timeout's thread method dumps the stacks and ends the worker; xdist names the test it was running
    with pytest.raises(AssertionError, match=r"crashed while running 'tests/test_hang.py::test_stuck'"):
        run_generated(tmp_path, tmp_path / "hang.log", "tests", "-n", "2", "--timeout=5", "--timeout-method=thread",
                      timeout=120)  # fmt: skip


def test_a_timeout_names_the_running_test(tmp_path):
    """The reporting itself: a generated test that hangs is named in the failure."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests/test_hang.py").write_text(
        "import time\n\ndef test_quick():\n    pass\n\ndef test_stuck():\n    time.sleep(600)\n"
    )
    with pytest.raises(pytest.fail.Exception, match=r"timed out after 20 s in tests/test_hang.py::test_stuck"):
        run_generated(tmp_path, tmp_path / "hang.log", "tests", timeout=20)
