"""Run a script of the project with one engine function replaced, for a negative control in its own process:

    python tests/patched.py MODULE:ATTRIBUTE=KIND SCRIPT ARGS...     (under torchrun too)

KIND `noop` makes ATTRIBUTE (a function, or a class's `Class.method`) do nothing; `nullcontext` makes it return a
context manager that does nothing. Then SCRIPT runs as `__main__` with ARGS, as `python SCRIPT ARGS` would.
"""

import contextlib
import importlib
import runpy
import sys
from pathlib import Path

KINDS = {"noop": lambda *args, **kwargs: None, "nullcontext": lambda *args, **kwargs: contextlib.nullcontext()}

patch, script, *args = sys.argv[1:]
sys.path[0] = str(Path(script).resolve().parent)  # what `python SCRIPT` puts first, instead of tests/
where, kind = patch.split("=")
module_name, attribute = where.split(":")
owner = importlib.import_module(module_name)
*path, name = attribute.split(".")
for part in path:
    owner = getattr(owner, part)
assert hasattr(owner, name), f"{where} does not exist: the negative control would test nothing"
setattr(owner, name, staticmethod(KINDS[kind]) if isinstance(owner, type) else KINDS[kind])
sys.argv = [script, *args]
runpy.run_path(script, run_name="__main__")
