"""The one exception type that `train.py` turns into a one-line message and a non-zero exit."""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user (config, checkpoint, data path): the message says what is wrong and what to do."""


def causes(exc: BaseException | None):
    """`exc`, then what it was raised from or while handling (`__cause__`, else `__context__`), and so on down."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def find_user_error(exc: BaseException) -> UserError | None:
    """The UserError behind `exc`, if any: Hydra's `instantiate` wraps what a `_target_` raises."""
    return next((e for e in causes(exc) if isinstance(e, UserError)), None)
