"""deterministic=true: deterministic kernels, without PyTorch's NaN fill of every new tensor (a ~7% CPU cost)."""

import torch
import torch.utils.deterministic

from {{ cookiecutter.package }}.engine.process import use_deterministic_kernels


def test_deterministic_kernels_without_the_fill_of_new_tensors():
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    try:
        use_deterministic_kernels()
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.utils.deterministic.fill_uninitialized_memory is False
        use_deterministic_kernels(fill_uninitialized=True)
        assert torch.empty(8).isnan().all()  # the fill it turns off: what PyTorch does by default in this mode
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.utils.deterministic.fill_uninitialized_memory = fill
