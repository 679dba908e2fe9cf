"""Process-wide settings, in one place: `process.*` in conf/config.yaml, and deterministic kernels.

Each one changes the whole process, not one object, so the entry points' Hydra main calls `setup(cfg)` once,
after the config checks, and nothing else changes them; one log line names what it changed. The allocator's
thresholds (`allocator`) are set earlier too, before the checks build the model. Nothing is
exported to the environment but CUBLAS_WORKSPACE_CONFIG (cuBLAS reads it there){% if cookiecutter.with_tracking == "yes" %} and, with
logger.use mlflow, MLflow's request bounds{% endif %}:
forked loader workers share the allocator's settings, which live in the process's memory, and run one thread
each. What each key does and what it measured: docs/training-step.md (#speed-on-the-cpu).
`process.omp_wait_policy` keeps OpenMP's threads from spinning on the cores the loader workers decode on;
OpenMP (libgomp) reads OMP_WAIT_POLICY once, as torch loads it, before any config exists: train.py and eval.py
set it from their command line before they import torch, and setup() says when OpenMP runs with another.
`process.keep_freed_memory`: glibc's malloc hands free memory at its heap's top back to the kernel, and the next
step faults it in again, page by page; fixed thresholds end that.

And one setting no key changes: the objects that exist when setup() runs (torch, torchvision, hydra: ~550,000)
are frozen (`gc.freeze`), out of the reach of every later collection; objects made later are collected as
before.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os

import torch
import torch.utils.deterministic
{% if cookiecutter.with_fsdp == "yes" %}

from .device import pick_device
{% endif %}

log = logging.getLogger(__name__)

MMAP_THRESHOLD = 32 * 2**20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit systems (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 2**30  # free memory at the heap's top beyond this still goes back to the kernel
GLIBC_START = 128 * 2**10  # both thresholds' starting values in glibc
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # malloc.h
MALLOC_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def setup(cfg) -> None:
    """The `process` keys and `deterministic`, applied once; one log line names the changes, one more says when
    OpenMP started with another wait policy than `process.omp_wait_policy` (the entry point sets it from the
    command line: another set in a config file, or exported, comes too late or wins)."""
    wanted = getattr(cfg.process.omp_wait_policy, "value", cfg.process.omp_wait_policy)  # the enum's value, or None
    started = os.environ.get("OMP_WAIT_POLICY", "").lower()
    if wanted is not None and started != wanted:
        line = "process.omp_wait_policy=%s does not apply: OpenMP started with OMP_WAIT_POLICY=%s"
        log.warning(line, wanted, started)
    gc.freeze()  # what the imports and the config made lives as long as the process: no collection walks it again
    changes = [f"{gc.get_freeze_count()} objects frozen"]
    changes += allocator(cfg)  # set before the checks built the model; named here, once
    if cfg.process.threads is not None:
        torch.set_num_threads(cfg.process.threads)
        changes.append(f"torch threads {cfg.process.threads}")
    if cfg.deterministic:
        use_deterministic_kernels()
        changes.append(f"deterministic kernels, CUBLAS_WORKSPACE_CONFIG={os.environ['CUBLAS_WORKSPACE_CONFIG']}")
{% if cookiecutter.with_tracking == "yes" %}
    if "mlflow" in cfg.get("logger", {}).get("use", ()):
        # every HTTP request of MLflow's bounded, by the variables it reads (its default retries with backoff can take
        # minutes against a dead server); a value you exported stays
        timeout = str(max(1, round(cfg.logger.timeout_s)))
        bounds = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": timeout}
        changes += [f"{name}={os.environ.setdefault(name, value)}" for name, value in bounds.items()]
{% endif %}
    log.info("process: %s", ", ".join(changes))


def allocator(cfg) -> list[str]:
    """glibc's malloc thresholds the run asks for, set (again: the same values) and named. preflight.check_run sets
    them before the model is built: glibc's own tuning raises its mmap threshold on every large block freed, so a
    dry step before them would leave its gathered units and gradients on the heap for the run's whole life."""
{% if cookiecutter.with_fsdp == "yes" %}
    if cfg.parallel.strategy == "fsdp" and pick_device(cfg.device).type == "cpu":
        # each sharded step frees a gathered unit and its whole gradient: back to the system (docs/distributed.md)
        if keep_freed_memory(GLIBC_START, GLIBC_START):
            return [f"malloc thresholds mmap and trim {GLIBC_START >> 10} KiB (parallel=fsdp on the CPU)"]
        return []
{% endif %}
    if cfg.process.keep_freed_memory and keep_freed_memory():
        return [f"malloc thresholds mmap {MMAP_THRESHOLD >> 20} MiB, trim {TRIM_THRESHOLD >> 20} MiB"]
    return []


def keep_freed_memory(mmap: int = MMAP_THRESHOLD, trim: int = TRIM_THRESHOLD) -> bool:
    """glibc's malloc thresholds for this process (mallopt, a public libc call); True when they now apply. Settings
    of yours (MALLOC_*_ variables, glibc.malloc tunables) are left to take effect instead.{% if cookiecutter.with_fsdp == "yes" %} parallel=fsdp on the CPU
    asks for glibc's starting values instead (`allocator`).{% endif %}"""
    if any(key in os.environ for key in MALLOC_ENV) or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # glibc's: musl's does nothing (returns 0), macOS and Windows have none
    except (AttributeError, OSError, TypeError):
        return False
    # ctypes passes Python ints as C ints and reads an int back by default: mallopt(int, int) -> int
    # the mmap threshold first: setting either one turns glibc's own tuning off, and it would stay at 128 KiB
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap) and mallopt(_M_TRIM_THRESHOLD, trim))


def use_deterministic_kernels(fill_uninitialized: bool = False) -> None:
    """deterministic=true: the same inputs give the same bits, which is what makes an exact resume checkable.

    PyTorch's deterministic mode also fills every new uninitialized tensor with NaN by default
    (`torch.utils.deterministic.fill_uninitialized_memory`): an extra write pass that changes no result of an op
    that writes its whole output, as every op of this loop does. It is off here; to hunt code that reads memory it
    never wrote, pass `fill_uninitialized=True`."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's deterministic mode reads it
    # warn_only: the config check's dry step has already refused, in one line, an op without a deterministic kernel
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = fill_uninitialized
    torch.backends.cudnn.benchmark = False  # its autotuner picks kernels by timing: not the same on every run
