"""What a task's `loss` may return, unpacked for the loop, and checked once by the dry step.

`task.loss(model, batch)` returns the scalar loss, or `(loss, parts)` with `parts` a dict of 0-dim tensors (the
terms of a composite loss: CE and Dice, a regulariser), logged at log points as `loss_<name>`. The loop unpacks it
on every step without looking at values (no host read); the dry step checks the form on two samples, in one line.
"""

from __future__ import annotations

import torch

from .errors import UserError


def split_loss(result) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, parts) of what `task.loss` returned: `parts` is {} for a bare loss. Python checks only."""
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict):
        return result[0], result[1]
    return result, {}


def check_loss(result, target: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`split_loss`, refusing in one line naming the task a loss that is not a scalar with a gradient, or parts
    that are not 0-dim tensors under string names."""
    loss, parts = split_loss(result)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        shown = f"a tuple of {len(result)}" if isinstance(result, tuple) else repr(loss)
        raise UserError(
            f"task {target}: loss() must return a scalar tensor with a gradient, or (loss, parts) with parts a "
            f"dict of 0-dim tensors, got {shown}"
        )
    for name, part in parts.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise UserError(f"task {target}: loss() parts need names like 'dice' (logged as loss_<name>), got {name!r}")
        if not isinstance(part, torch.Tensor) or part.dim() != 0:
            what = f"a tensor of shape {tuple(part.shape)}" if isinstance(part, torch.Tensor) else type(part).__name__
            raise UserError(
                f"task {target}: loss() part {name!r} must be a 0-dim tensor (e.g. the term's batch mean), got {what}"
            )
    return loss, parts
