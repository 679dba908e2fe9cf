"""deterministic=true: the same inputs give the same bits, which is what makes an exact resume checkable.

PyTorch's deterministic mode also fills every new uninitialized tensor (`torch.empty`, and the outputs and
temporaries every kernel allocates) with NaN by default (`torch.utils.deterministic.fill_uninitialized_memory`).
That extra write pass costs about 7% of a SmallCNN step on the CPU and changes no result of an op that writes
its whole output, which every op in this project's loop does; it exists to expose code that reads memory it
never wrote. The fill is off here; to hunt such a bug in code of your own, set
`torch.utils.deterministic.fill_uninitialized_memory = True` after this runs.
"""

from __future__ import annotations

import os

import torch
import torch.utils.deterministic


def use_deterministic_kernels(fill_uninitialized: bool = False) -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's deterministic mode needs it
    # warn_only: the config check's dry step has already refused, in one line, an op without a deterministic kernel
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = fill_uninitialized
