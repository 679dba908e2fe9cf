"""{{ cookiecutter.description }}

The rooms of this package:

- yours, the problem: `tasks.py` (loss and metrics), `data.py` and `stream.py` (data sets), `model.py` (models).
  Add your own classes here or in files of your own, and name them in `conf/task/`, `conf/data/`, `conf/model/`.
- the tools: `doctor.py` (`python -m {{ cookiecutter.package }}.doctor`, measures the loader profiles) and
  `shards.py` (`python -m {{ cookiecutter.package }}.shards pack`, and the data set that reads the shards).
- the engine, which you need not open: `engine/` (loader, resume, checkpoint, rng, preempt, distributed, device,
  memory, monitor, runlog, schedule, config, evaluate, submit, errors).
"""

import importlib
import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"

# The engine's modules lived at the top of the package before: `{{ cookiecutter.package }}.device.Normalize`,
# `{{ cookiecutter.package }}.config.CheckBeforeRun` and `from {{ cookiecutter.package }} import loader` still work,
# as the same module objects.
MOVED = {
    f"{__name__}.{name}": f"{__name__}.engine.{name}"
    for name in (
        "checkpoint",
        "config",
        "device",
        "distributed",
        "errors",
        "evaluate",
        "loader",
        "memory",
        "monitor",
        "preempt",
        "resume",
        "rng",
        "runlog",
        "schedule",
        "submit",
    )
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`import <package>.loader` hands back `<package>.engine.loader` itself (one module, not a copy)."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        module = importlib.import_module(MOVED[spec.name])
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module) -> None:
        module.__spec__ = module.__spec__.loader_state  # importlib set the alias's spec on the module: undo that


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())
