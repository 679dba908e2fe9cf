"""Run train.py with every host read of a tensor counted: `python tests/count_reads.py OUT.json ARGS...`.

A host read is a call that hands a tensor's values to Python: `item`, `tolist`, `cpu`, `numpy`, and `float()`,
`int()`, `bool()`, `index` of a tensor. On a GPU each one waits for the device to finish its queued work.
Only the main process counts (DataLoader workers fork from it and would patch themselves too). Each read is
charged to the innermost frame in this project's own code (tests excluded), so a read inside torch counts
for the project line that called into torch: `train.py` for the loop, `{{ cookiecutter.package }}/engine/loader.py`
for the sampler. OUT.json maps `file` to its count.
"""

import atexit
import collections
import json
import os
import runpy
import sys
from pathlib import Path

import torch

PROJECT = Path(__file__).resolve().parents[1]
TESTS = PROJECT / "tests"
READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")
counts: collections.Counter = collections.Counter()
main_pid = os.getpid()


def charged_to() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if path.is_relative_to(PROJECT) and not path.is_relative_to(TESTS):
            return str(path.relative_to(PROJECT))
        frame = frame.f_back
    return "outside the project"


def counted(name: str):
    original = getattr(torch.Tensor, name)

    def read(self, *args, **kwargs):
        if os.getpid() == main_pid:
            counts[charged_to()] += 1
        return original(self, *args, **kwargs)

    return read


for name in READS:
    setattr(torch.Tensor, name, counted(name))
out = Path(sys.argv[1])
atexit.register(lambda: os.getpid() == main_pid and out.write_text(json.dumps(counts)))
sys.argv = ["train.py", *sys.argv[2:]]
sys.path.insert(0, str(PROJECT))
runpy.run_path(str(PROJECT / "train.py"), run_name="__main__")
