"""engine/process.py: the process-wide settings. A step's freed memory stays with the process (the next step does not
fault it back in), OpenMP's wait policy is set as torch loads, and neither reaches the processes the run starts."""

import os
import platform
import subprocess
import sys

import pytest

from {{ cookiecutter.package }}.engine import process
from tests.helpers import PROJECT, read_jsonl, run_train

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the thresholds are glibc's")

USER_KEYS = (*process.MALLOC_ENV, "GLIBC_TUNABLES")

# A convolution step's forward and backward, timed in page faults once the heap has grown to what a step needs.
# One OpenMP thread: every allocation then comes from the main heap, whose trimming is what is measured.
STEP_FAULTS = """
import resource, sys
import torch
import torch.nn.functional as F
from {{ cookiecutter.package }}.engine.process import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
elif sys.argv[1] == "try":
    keep_freed_memory()
x = torch.randn(64, 3, 32, 32)
w1, w2 = torch.randn(32, 3, 3, 3, requires_grad=True), torch.randn(64, 32, 3, 3, requires_grad=True)
def step():
    F.conv2d(F.max_pool2d(F.relu(F.conv2d(x, w1, padding=1)), 2), w2, padding=1).square().mean().backward()
for _ in range(5):
    step()
windows = []  # faults per step over 9 windows of 5 steps: the median window, so a one-off growth does not count
for _ in range(9):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        step()
    windows.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)
print(sorted(windows)[4])
"""


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in USER_KEYS}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def faults_per_step(mode: str, **env) -> float:
    out = subprocess.run(
        [sys.executable, "-c", STEP_FAULTS, mode], cwd=PROJECT, env=clean_env(**env), capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return float(out.stdout.strip())


@glibc
@pytest.mark.slow  # two starts of torch, about 10 s; the fast tier: the settings are applied and kept (tests below)
def test_a_step_no_longer_faults_back_the_memory_the_last_one_freed():
    kept, default = faults_per_step("keep"), faults_per_step("default")
    # glibc's own policy hands the step's activations back and faults them in again: thousands of pages a step
    assert default > 500, default
    assert kept < 0.01 * default, (kept, default)


@glibc
def test_settings_of_the_user_are_left_to_take_effect_and_none_reaches_a_child():
    probe = "from {{ cookiecutter.package }}.engine.process import keep_freed_memory as k; import os; " \
        "print(k(), os.environ.get('MALLOC_TRIM_THRESHOLD_'))"  # fmt: skip
    runs = {
        "fresh": {},
        "user": {"MALLOC_TRIM_THRESHOLD_": "0"},
        "tunables": {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"},
    }
    seen = {}
    for name, env in runs.items():
        out = subprocess.run([sys.executable, "-c", probe], cwd=PROJECT, env=clean_env(**env), capture_output=True,
                             text=True)  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        seen[name] = out.stdout.split()
    assert seen["fresh"] == ["True", "None"]  # applied, and not exported to the processes it starts
    assert seen["user"] == ["False", "0"]
    assert seen["tunables"] == ["False", "None"]


@glibc
@pytest.mark.slow  # a start of torch; the fast tier: the user's settings are left in place (the test above)
def test_the_users_own_threshold_really_rules():
    """The step faults as glibc's default would have it, or worse."""
    assert faults_per_step("try", MALLOC_TRIM_THRESHOLD_="0") > 500


@pytest.mark.slow
@glibc
def test_train_py_keeps_freed_memory_and_reports_page_faults(tmp_path):
    """metrics.jsonl's page_faults_per_batch (main process): a handful once the heap has grown (an epoch that grows
    it faults more); the negative control, process.keep_freed_memory=false, leaves glibc's own policy."""
    figures = {}
    for name, flag in (("kept", "true"), ("given back", "false")):
        run_dir = tmp_path / name.replace(" ", "_")
        run_train(run_dir, "experiment=debug", "epochs=3", f"process.keep_freed_memory={flag}")
        figures[name] = [line["page_faults_per_batch"] for line in read_jsonl(run_dir / "metrics.jsonl")]
    assert all(isinstance(f, float) for fs in figures.values() for f in fs), figures
    assert min(figures["kept"][1:]) < 0.05 * min(figures["given back"][1:]), figures


WAIT_PROBE = "import os, sys, train; print(os.environ.get('OMP_WAIT_POLICY'), train.process.applied_wait_policy)"


@pytest.mark.parametrize(
    ("argv", "given", "applied"),
    [
        ([], None, "passive"),
        # a start of torch each (about 5 s): the command line's choice and the user's own variable in the slow tier
        pytest.param(["process.omp_wait_policy=active"], None, "active", marks=pytest.mark.slow),
        pytest.param([], "ACTIVE", "None", marks=pytest.mark.slow),
    ],
)
def test_openmp_wait_policy_is_set_as_torch_loads_and_not_left_for_children(argv, given, applied):
    """train.py gives OpenMP `process.omp_wait_policy` (conf/config.yaml's, or the command line's) while torch loads,
    then takes it out of the environment again; an OMP_WAIT_POLICY of the user's stays and is not replaced."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given:
        env["OMP_WAIT_POLICY"] = given
    probe = f"import sys; sys.argv = ['train.py', *{argv!r}]; " + WAIT_PROBE
    out = subprocess.run([sys.executable, "-c", probe], cwd=PROJECT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(given), applied]


FROZEN = """
import gc, sys, weakref
from {{ cookiecutter.package }}.engine import process

class Node:
    pass

def cycle():  # garbage only the cyclic collector frees; the weak reference says whether it did
    node = Node()
    node.self = node
    return weakref.ref(node)

if sys.argv[1] == "disabled":
    gc.disable()
with process.long_lived_imports():
    during = gc.isenabled()
    import email.mime.text  # a module this process has not loaded yet
    inside = cycle()
outside = cycle()
gc.collect()
print(during, gc.isenabled(), inside() is not None, outside() is None, gc.get_freeze_count())
"""


@pytest.mark.parametrize("state", ["enabled", "disabled"])
def test_long_lived_imports_are_frozen_and_later_objects_still_collected(state):
    out = subprocess.run([sys.executable, "-c", FROZEN, state], cwd=PROJECT, capture_output=True, text=True, check=True)
    during, after, kept, collected, frozen = out.stdout.split()
    assert during == "False"  # no collection while the imports load
    assert after == str(state == "enabled")  # the collector as it was before
    assert kept == "True" and int(frozen) > 1000  # what the block made is out of the collector's reach...
    assert collected == "True"  # ...and garbage made after it is collected as before (the control)


@pytest.mark.parametrize("script", ["train", pytest.param("eval", marks=pytest.mark.slow)])  # the same call
def test_train_py_and_eval_py_freeze_what_their_imports_made(script):
    code = f"import gc; before = gc.get_freeze_count(); import {script}; print(before, gc.get_freeze_count())"
    out = subprocess.run([sys.executable, "-c", code], cwd=PROJECT, capture_output=True, text=True, check=True)
    before, after = map(int, out.stdout.split())
    assert before == 0 and after > 100_000, (script, before, after)  # torch, torchvision, hydra: ~500,000
