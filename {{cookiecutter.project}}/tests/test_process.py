"""engine/process.py: the process-wide settings. A step's freed memory stays with the process (the next step does not
fault it back in), setup() names what it changes and says when OpenMP's wait policy came too late, and the stop
signals' handlers are ours only while installed."""

import os
import platform
import signal
import subprocess
import sys
import threading

import pytest

from {{ cookiecutter.package }}.engine import process
from {{ cookiecutter.package }}.engine.preempt import StopRequest
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
    kept = faults_per_step("keep")
    # glibc's own policy hands the step's activations back and faults them in again: thousands of pages a step in
    # most processes. Its threshold moves with where the heap's top lands (address randomisation), so one process in
    # about fifteen faults less (0 to 4,480 a step seen): up to four tries, the most counts.
    default = 0.0
    for _ in range(4):
        default = max(default, faults_per_step("default"))
        if default > 500:
            break
    assert default > 500, default
    assert kept < 0.01 * default, (kept, default)


@pytest.mark.slow  # the fast tier stays under 240 s on two cores (issue 50 item 7)
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
    it faults more); the negative control, process.keep_freed_memory=false, leaves glibc's own policy. 20 steps an
    epoch: what an epoch does once (up to ~1,000 faults, e.g. Python's own arenas) is shared by 20 batches, not 5."""
    figures = {}
    for name, flag in (("kept", "true"), ("given back", "false")):
        run_dir = tmp_path / name.replace(" ", "_")
        overrides = ("experiment=debug", "epochs=4", "data.per_class=160", f"process.keep_freed_memory={flag}")
        run_train(run_dir, *overrides)
        figures[name] = [line["page_faults_per_batch"] for line in read_jsonl(run_dir / "metrics.jsonl")]
    assert all(isinstance(f, float) for fs in figures.values() for f in fs), figures
    assert min(figures["kept"][1:]) < 0.05 * min(figures["given back"][1:]), figures


# process.setup() with every key set, its log lines on stdout, then what it left: frozen objects, threads, cuBLAS
SETUP = """
import gc, logging, os, sys
import torch
from omegaconf import OmegaConf
from {{ cookiecutter.package }}.engine import process
from {{ cookiecutter.package }}.engine.preempt import StopRequest
logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
keys = {"omp_wait_policy": sys.argv[1], "keep_freed_memory": True, "threads": 1}
print(gc.get_freeze_count())
process.setup(OmegaConf.create({"process": keys, "deterministic": True, "parallel": {"strategy": "ddp"}}))
print(torch.get_num_threads(), os.environ["CUBLAS_WORKSPACE_CONFIG"])
"""


@pytest.mark.slow  # the fast tier stays under 240 s on two cores (issue 50 item 7)
@glibc
@pytest.mark.parametrize("exported", [None, "PASSIVE"])
def test_setup_names_its_changes_and_says_when_the_wait_policy_comes_too_late(exported):
    """OpenMP read OMP_WAIT_POLICY as torch loaded: setup() says when it started with another policy than the key's."""
    env = {k: v for k, v in clean_env().items() if k not in ("OMP_WAIT_POLICY", "CUBLAS_WORKSPACE_CONFIG")}
    out = subprocess.run([sys.executable, "-c", SETUP, "passive"], cwd=PROJECT, capture_output=True, text=True,
                         env={**env, "OMP_WAIT_POLICY": exported} if exported else env)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    before, *lines, after = out.stdout.strip().splitlines()
    frozen = lines[-1].split()[1]
    assert before == "0" and int(frozen) > 100_000  # torch and hydra's objects, out of the collector's reach
    assert after.split() == ["1", ":4096:8"]
    changes = f"process: {frozen} objects frozen, malloc thresholds mmap 32 MiB, trim 1024 MiB, torch threads 1, " \
        "deterministic kernels, CUBLAS_WORKSPACE_CONFIG=:4096:8"  # fmt: skip
    late = "process.omp_wait_policy=passive does not apply: OpenMP started with OMP_WAIT_POLICY="
    assert lines == ([changes] if exported else [late, changes])  # an exported policy: nothing to say (the control)


# CPU seconds the process burns while its main thread sleeps after a parallel op: OpenMP's threads spinning
SPIN = """
import os, resource, sys, time
if sys.argv[1] == "before":
    os.environ["OMP_WAIT_POLICY"] = "ACTIVE"
import torch
if sys.argv[1] == "after":
    os.environ["OMP_WAIT_POLICY"] = "ACTIVE"
torch.set_num_threads(2)
x = torch.randn(2000, 2000)
spun = 0.0
for _ in range(5):
    x.add_(1.0)
    start = resource.getrusage(resource.RUSAGE_SELF).ru_utime
    time.sleep(0.1)
    spun += resource.getrusage(resource.RUSAGE_SELF).ru_utime - start
print(spun)
"""


@pytest.mark.slow  # three starts of torch; the fast tier: what setup() says about it (the test above)
def test_openmp_reads_its_wait_policy_as_torch_loads_not_later():
    """Why train.py sets the wait policy before `import torch`: set before it, the threads spin through the sleeps;
    set after it, before any parallel op, nothing changes (as with no policy at all, the control)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    spun = {}
    for when in ("before", "after", "never"):
        out = subprocess.run([sys.executable, "-c", SPIN, when], env=env, capture_output=True, text=True, check=True)
        spun[when] = float(out.stdout)
    # 0.5 s of sleep, a thread spinning through it; with another test on the other core it gets less of its own
    # (0.25 s seen in CI), so against the two controls, not a fixed share
    assert spun["before"] > 0.1 and spun["before"] > 5 * max(spun["after"], spun["never"]), spun
    assert spun["after"] < 0.2 and spun["never"] < 0.2, spun


@pytest.mark.slow  # two runs; the fast tier: what setup() says (above)
def test_train_py_sets_the_wait_policy_from_its_command_line(tmp_path):
    """train.py sets OMP_WAIT_POLICY from its command line before it imports torch (the test above shows why): the
    key applies as given; the control, another policy exported, wins and the log says the key does not apply."""
    run = ["experiment=debug", "max_steps=1", "process.omp_wait_policy=active"]
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    applied = subprocess.run([sys.executable, "train.py", *run, f"hydra.run.dir={tmp_path / 'applied'}"], cwd=PROJECT,
                             env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert applied.returncode == 0 and "does not apply" not in applied.stdout + applied.stderr, applied.stderr[-2000:]
    exported = run_train(tmp_path / "exported", *run, env={"OMP_WAIT_POLICY": "PASSIVE"})
    line = "process.omp_wait_policy=active does not apply: OpenMP started with OMP_WAIT_POLICY=passive"
    assert line in exported.stdout + exported.stderr


def test_stop_signals_are_ours_inside_installed_only_and_the_previous_handlers_come_back():
    """A signal inside the block sets the flag; after it the handler that was there before answers again."""
    heard = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: heard.append(signum))
    interrupt = signal.getsignal(signal.SIGINT)  # Python's default handler, or SIG_IGN when started in the background
    try:
        stop = StopRequest()
        with stop.installed():
            assert signal.getsignal(signal.SIGINT) == stop._handle
            signal.raise_signal(signal.SIGUSR1)
        assert stop.requested and not heard
        assert signal.getsignal(signal.SIGINT) is interrupt
        assert signal.set_wakeup_fd(-1) == -1  # no wakeup pipe left behind
        signal.raise_signal(signal.SIGUSR1)
        assert heard == [signal.SIGUSR1]  # the handler from before the block (the control)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    watchers = [t for t in threading.enumerate() if t.name == "sigterm-while-waiting"]
    for t in watchers:
        t.join(timeout=2)
    assert not any(t.is_alive() for t in watchers)


# A main thread that waits (a sleep standing in for a collective on a dead peer) with the stop handlers installed
WAIT = """
import contextlib, os, signal, sys, time
from {{ cookiecutter.package }}.engine.preempt import StopRequest
stop = StopRequest()
with stop.installed(), stop.waiting_on_peers(0.5) if sys.argv[1] == "waiting" else contextlib.nullcontext():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(3)
print("flag", stop.requested)
"""


@pytest.mark.parametrize("state", ["waiting", "stepping"])
def test_a_sigterm_while_waiting_on_peers_ends_the_process_after_its_grace(state):
    """The watcher ends the process (exit 143) once the wait has outlasted its grace; outside a wait (the control)
    the signal only sets the flag, and the run goes on to save."""
    out = subprocess.run([sys.executable, "-c", WAIT, state], cwd=PROJECT, capture_output=True, text=True, timeout=60)
    if state == "waiting":
        assert out.returncode == 128 + signal.SIGTERM, out
        assert "SIGTERM while waiting on the other processes for over 0.5 s: exiting now" in out.stderr, out
    else:
        assert out.returncode == 0 and out.stdout.split() == ["flag", "True"], out
