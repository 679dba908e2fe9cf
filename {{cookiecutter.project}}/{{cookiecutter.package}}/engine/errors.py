"""The one exception type that `train.py` turns into a one-line message and a non-zero exit."""

from __future__ import annotations

from hydra.errors import InstantiationException


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
    """The UserError behind `exc` (Hydra's `instantiate` wraps what a `_target_` raises), if any. A `_target_` that
    cannot be found, or that is called with arguments it does not take (a typo in `+data.train.sizes=10`), is a
    config error too; anything else a target raises keeps its traceback."""
    for e in causes(exc):
        if isinstance(e, UserError):
            return e
        if isinstance(e, InstantiationException) and (e.__cause__ is None or isinstance(e.__cause__, TypeError)):
            cause = f" ({reason(e)})" if e.__cause__ else ""  # the TypeError's own line
            return UserError(f"config: {first_line(e) or type(e).__name__}{cause}"[:400])
    return None


def reason(e: BaseException) -> str:
    """The error a `_target_` raised, without Hydra's wrapping, in one line. Only Hydra's wrapper is unwrapped: another
    error's cause (PIL's struct.error under "image file is truncated") says less than the error itself."""
    inner = e.__cause__ if isinstance(e, InstantiationException) and e.__cause__ is not None else e
    return f"{type(inner).__name__}: {first_line(inner)}"[:300]


def first_line(e: BaseException) -> str:
    """`e`'s message's first line that is not blank, stripped ("" for none)."""
    return next((line.strip() for line in str(e).splitlines() if line.strip()), "")
