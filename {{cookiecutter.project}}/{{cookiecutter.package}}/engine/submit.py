"""What `python train.py -m hydra/launcher=slurm` (or `submitit_local`) needs from the entry point.

Hydra's submitit launcher cloudpickles itself, with `main()`, into the job folder; the job process
loads that pickle and calls it. A function defined in `__main__` (train.py) cannot be imported by
name in the job, so cloudpickle pickles it by value: its code, and everything that code reaches,
down to the modules named in it. Modules are pickled by reference (imported again by name in the
job), but cloudpickle recognises a module by its exact type, and some of torch's are instances of
a module subclass: `torch.backends.cudnn` is a `CudnnModule` (it turns `cudnn.benchmark` into a
property). So `torch.backends.cudnn.benchmark = False` anywhere in train.py made the submission
fail with `TypeError: cannot pickle 'CudnnModule' object` before any job started
(cloudpipe/cloudpickle#405, pytorch/pytorch#48832, facebookresearch/hydra#1180).
"""

from __future__ import annotations

import copyreg
import importlib
import sys
import types


def picklable_modules() -> None:
    """Pickle every module-subclass instance loaded so far by name, as cloudpickle does plain modules.

    Called by train.py once its imports are done, so the torch.backends modules (and any such
    module a user's train.py imports) are covered when the launcher pickles `main()`. The job
    process gets the very same module back by importing it by name.
    """
    for module in list(sys.modules.values()):
        kind = type(module)
        if isinstance(module, types.ModuleType) and kind is not types.ModuleType and _importable(module):
            copyreg.pickle(kind, _by_name)


def _importable(module: types.ModuleType) -> bool:
    return sys.modules.get(getattr(module, "__name__", None)) is module


def _by_name(module: types.ModuleType):
    return _import, (module.__name__,)


def _import(name: str) -> types.ModuleType:
    """Unpickling in the job: the module, and its type registered there too, because the job pickles
    `main()` again when submitit checkpoints it for a requeue (train.py's own call does not run there)."""
    module = importlib.import_module(name)
    copyreg.pickle(type(module), _by_name)
    return module
