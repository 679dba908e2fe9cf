"""The one exception type that `train.py` turns into a one-line message and a non-zero exit."""


class UserError(Exception):
    """Bad input from the user (config, checkpoint, data path): the message says what is wrong and what to do."""


def find_user_error(exc: BaseException) -> "UserError | None":
    """The UserError behind `exc`, if any: Hydra's `instantiate` wraps what a `_target_` raises.

    A `_target_` that cannot be found, or that is called with arguments it does not take (a typo in
    `+data.train.sizes=10`), is a config error too; anything else a target raises keeps its traceback.
    """
    from hydra.errors import InstantiationException

    while exc is not None:
        if isinstance(exc, UserError):
            return exc
        if isinstance(exc, InstantiationException) and (exc.__cause__ is None or isinstance(exc.__cause__, TypeError)):
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            cause = f" ({type(exc.__cause__).__name__}: {str(exc.__cause__).splitlines()[0]})" if exc.__cause__ else ""
            return UserError(f"config: {lines[0] if lines else type(exc).__name__}{cause}"[:400])
        exc = exc.__cause__ or exc.__context__
    return None
