"""Process-wide settings, in one place: `process.*` in conf/config.yaml, and deterministic kernels.

Each one changes the whole process, not one object, so train.py applies them once, here, and nowhere else.
Nothing is exported to the environment: processes the run starts do not inherit them (forked loader workers
share the allocator's settings, which live in the process's memory, and run one thread each). What each key does
and what it measured: docs/training-step.md (#speed-on-the-cpu). `process.omp_wait_policy` keeps OpenMP's threads
from spinning on the cores the loader workers decode on; OpenMP reads it once, as torch loads, so train.py applies
it around its `import torch` (`openmp_wait_policy`). `process.keep_freed_memory`: glibc's malloc hands free memory
at its heap's top back to the kernel, and the next step faults it in again, page by page; fixed thresholds end that.

And one setting no key changes: the objects an entry point's imports make are frozen (`long_lived_imports`).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import re
import sys
from pathlib import Path

from omegaconf import OmegaConf

log = logging.getLogger(__name__)

MMAP_THRESHOLD = 32 * 2**20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit systems (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 2**30  # free memory at the heap's top beyond this still goes back to the kernel
GLIBC_START = 128 * 2**10  # both thresholds' starting values in glibc
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # malloc.h
MALLOC_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")

applied_wait_policy: str | None = None  # what openmp_wait_policy() gave OpenMP, for apply() to compare


@contextlib.contextmanager
def openmp_wait_policy(argv: list[str], conf_dir: Path):
    """Around train.py's `import torch`: OMP_WAIT_POLICY set from `process.omp_wait_policy` (the command line's
    value, else conf/config.yaml's) while torch loads, then the environment as it was. A value you exported stays."""
    global applied_wait_policy
    given = [m[1].strip("'\"") for arg in argv if (m := re.fullmatch(r"\+{0,2}process\.omp_wait_policy=(.*)", arg))]
    wanted = given[-1] if given else None  # the last one given wins, as with Hydra
    if wanted is None and (conf_dir / "config.yaml").is_file():
        wanted = OmegaConf.select(OmegaConf.load(conf_dir / "config.yaml"), "process.omp_wait_policy")
    set_here = "torch" not in sys.modules and "OMP_WAIT_POLICY" not in os.environ and wanted not in (None, "null")
    if set_here:
        os.environ["OMP_WAIT_POLICY"] = str(wanted).upper()
    applied_wait_policy = str(wanted).lower() if set_here else None
    try:
        yield
    finally:
        if set_here:
            del os.environ["OMP_WAIT_POLICY"]


@contextlib.contextmanager
def long_lived_imports():
    """Around an entry point's imports: no cyclic garbage collection while they load, then every object they made
    moved out of the collector's reach (`gc.freeze`, python/cpython#75739).

    torch, torchvision (which loads torch._dynamo and sympy) and hydra make hundreds of thousands of tracked
    objects that live as long as the process, yet each full collection walks them all, while they load and at
    exit: every train.py, eval.py and torchrun rank starts and ends sooner (docs/training-step.md). Objects made
    later (the model, the data, each step's tensors) are collected as before."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def apply(cfg) -> None:
    """The `process` keys that can be set once the config is composed; says when the wait policy came too late."""
    wanted = getattr(cfg.process.omp_wait_policy, "value", cfg.process.omp_wait_policy)  # the enum's value, or None
    if wanted is not None and applied_wait_policy is not None and str(wanted) != applied_wait_policy:
        log.warning(
            "process.omp_wait_policy=%s is set after OpenMP read its wait policy (%s) as torch loaded: set it on the "
            "command line or in conf/config.yaml", wanted, applied_wait_policy,
        )  # fmt: skip
    if cfg.process.keep_freed_memory:
        keep_freed_memory()
    if cfg.process.threads is not None:
        import torch  # loaded already by the caller; this module must not load it (see openmp_wait_policy)

        torch.set_num_threads(cfg.process.threads)
    if cfg.deterministic:
        use_deterministic_kernels()


def keep_freed_memory(mmap: int = MMAP_THRESHOLD, trim: int = TRIM_THRESHOLD) -> bool:
    """glibc's malloc thresholds for this process (mallopt, a public libc call); True when they now apply. Settings
    of yours (MALLOC_*_ variables, glibc.malloc tunables) are left to take effect instead.{% if cookiecutter.with_fsdp == "yes" %} parallel=fsdp on the CPU
    asks for glibc's starting values instead (fsdp.build).{% endif %}"""
    if any(key in os.environ for key in MALLOC_ENV) or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # glibc's: musl's does nothing (returns 0), macOS and Windows have none
    except (AttributeError, OSError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # the mmap threshold first: setting either one turns glibc's own tuning off, and it would stay at 128 KiB
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap) and mallopt(_M_TRIM_THRESHOLD, trim))


def use_deterministic_kernels(fill_uninitialized: bool = False) -> None:
    """deterministic=true: the same inputs give the same bits, which is what makes an exact resume checkable.

    PyTorch's deterministic mode also fills every new uninitialized tensor with NaN by default
    (`torch.utils.deterministic.fill_uninitialized_memory`): an extra write pass that changes no result of an op
    that writes its whole output, as every op of this loop does. It is off here; to hunt code that reads memory it
    never wrote, pass `fill_uninitialized=True`."""
    import torch  # see apply()
    import torch.utils.deterministic

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's deterministic mode reads it
    # warn_only: the config check's dry step has already refused, in one line, an op without a deterministic kernel
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = fill_uninitialized
    torch.backends.cudnn.benchmark = False  # its autotuner picks kernels by timing: not the same on every run
