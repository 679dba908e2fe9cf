"""The one exception type that `train.py` turns into a one-line message and a non-zero exit."""


class UserError(Exception):
    """Bad input from the user (config, checkpoint, data path): the message says what is wrong and what to do."""


def find_user_error(exc: BaseException) -> "UserError | None":
    """The UserError behind `exc`, if any: Hydra's `instantiate` wraps what a `_target_` raises."""
    while exc is not None:
        if isinstance(exc, UserError):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None
