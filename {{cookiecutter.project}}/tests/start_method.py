"""`python tests/start_method.py METHOD train.py ARGS...`: train.py with its DataLoader workers started by METHOD.

Python 3.14 starts new processes with forkserver on Linux, and spawn is the default on macOS and Windows: the
workers then receive the dataset pickled instead of inheriting the parent's memory. This sets the default start
method, as the interpreter would, and runs train.py as `python train.py ARGS...` runs it.
"""

import multiprocessing
import runpy
import sys
from pathlib import Path

if __name__ == "__main__":  # spawned workers import this file again, as __mp_main__: they must not start a run
    multiprocessing.set_start_method(sys.argv[1])
    sys.argv = sys.argv[2:]
    sys.path[0] = str(Path(sys.argv[0]).resolve().parent)  # as if train.py had been started: its folder first
    runpy.run_path(sys.argv[0], run_name="__main__")
