"""The exceptions `train.py` turns into one `error:` line and a non-zero exit: bad input (`UserError`, exit 2), and an
exception raised in the user's own code (`CodeError`, exit 1), shown with its traceback first."""

import re
import sysconfig
import traceback
from pathlib import Path

from hydra.errors import InstantiationException

ENGINE = Path(__file__).resolve().parent
PACKAGE = ENGINE.parent  # the project's package: its modules outside engine/ are the user's (model.py, tasks.py...)
LIBRARIES = [Path(sysconfig.get_paths()[key]).resolve() for key in ("stdlib", "platstdlib", "purelib", "platlib")]


class UserError(Exception):
    """Bad input from the user (config, checkpoint, data path): the message says what is wrong and what to do."""

    trace = ""  # a data set's failure: the traceback of the sample that raised (`user_trace`), shown before the line


class CodeError(Exception):
    """An exception raised in the user's own code (a model, task, data set, collate or callback), not bad input:
    train.py shows `trace` (their frames and the library calls they made), then this one line saying where."""

    exit_code = 1

    def __init__(self, message: str, trace: str):
        super().__init__(message)
        self.trace = trace


def yours(filename: str) -> bool:
    """Whether a frame's file is the user's code: the package outside engine/, or any file outside Python's and the
    installed libraries' folders (a module of yours beside train.py)."""
    parents = Path(filename).resolve().parents
    if filename.startswith("<") or ENGINE in parents:
        return False
    return PACKAGE in parents or not any(library in parents for library in LIBRARIES)


def unwrapped(e: BaseException) -> BaseException:
    """The error a `_target_` raised: the cause of Hydra's InstantiationException, else `e` itself."""
    return e.__cause__ if isinstance(e, InstantiationException) and e.__cause__ is not None else e


def user_trace(e: BaseException) -> str:
    """`e`'s traceback from its first frame in the user's code on, the engine's frames left out, or "" when none is
    theirs, or when it is a check of theirs refusing its input: a ValueError the first of their frames raised
    itself (EarlyStopping(patience=0)), or an OSError (a file that cannot be read: bad data, not code). An error
    Hydra wrapped is its cause's; a DataLoader worker's comes as the text PyTorch puts in the message, shown whole."""
    inner = unwrapped(e)
    if isinstance(inner, OSError):
        return ""
    if "Original Traceback" in (text := str(inner)):  # raised in a worker: the worker's own traceback, as text
        return f"{text.rstrip()}\n" if any(map(yours, re.findall(r'File "([^"]+)", line', text))) else ""
    frames = traceback.extract_tb(inner.__traceback__)
    first = next((i for i, frame in enumerate(frames) if yours(frame.filename)), None)
    if first is None or (isinstance(inner, ValueError) and first == len(frames) - 1):
        return ""
    shown = [frame for frame in frames[first:] if ENGINE not in Path(frame.filename).resolve().parents]
    head = "Traceback (most recent call last; the engine's own calls left out):\n"
    return "".join([head, *traceback.format_list(shown), *traceback.format_exception_only(inner)])


def in_your_code(e: BaseException, what: str) -> CodeError | None:
    """A CodeError for `e` (`what`: where the run was), when its traceback passes through the user's code; `e`
    itself when it is one."""
    if isinstance(e, CodeError):
        return e
    trace = user_trace(e)
    return CodeError(f"{what}: {reason(e)}", trace) if trace else None


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


def reason(e: BaseException) -> str:
    """The error a `_target_` raised, without Hydra's wrapping, in one line. Only Hydra's wrapper is unwrapped: another
    error's cause (PIL's struct.error under "image file is truncated") says less than the error itself."""
    inner = unwrapped(e)
    if type(inner) is ImportError and inner.__cause__ is not None:  # Hydra wraps the import's own error
        inner = inner.__cause__
    return f"{type(inner).__name__}: {first_line(inner)}"[:300]


def first_line(e: BaseException) -> str:
    """`e`'s message's first line that is not blank, stripped ("" for none)."""
    return next((line.strip() for line in str(e).splitlines() if line.strip()), "")
