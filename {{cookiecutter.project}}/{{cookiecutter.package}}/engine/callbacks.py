"""The callbacks seam: the `callbacks` config key's named nodes, built once, called at the loop's hooks, and their
state saved in every checkpoint under their names.

Hooks, each optional on a callback (`run`: a read-only `RunView` of the run, the names in `SEEN`):
- `on_run_start(run)`: once, before the first step (after a resume's state is back);
- `on_log(run, figures)`: at each steps.jsonl line, with the figures the loop has already read (no extra read);
- `on_validation_end(run, record)`: with the record just written to metrics.jsonl, before the checkpoint that keeps
  it; a true value (True, or a string saying why) asks the run to stop there: it saves and exits 0;
- `on_run_end(run)`: once, however the loop ended (not after an error).

A node with `state_dict()` / `load_state_dict()` (a callback, or any Stateful object of yours: a curriculum, a
counter) is saved and restored with the run. A callback must not change the run: one that draws random numbers
draws from a generator of its own.
"""

from __future__ import annotations

import logging

from . import parts
from .errors import UserError

log = logging.getLogger("train")


# What a callback's hooks see of the run (docs/callbacks.md says what each is): these names, read when asked
SEEN = ("model", "evaluated", "train_loader", "val_loader", "train_set", "collate", "prepare", "step",
        "device", "cfg", "world", "run_dir", "runlog")  # fmt: skip


class RunView:
    """The run as its callbacks see it: the names in SEEN, each read from the run when asked (`step` is
    the current one); any other name, or setting one, fails naming what there is."""

    __slots__ = ("_run",)

    def __init__(self, run):
        object.__setattr__(self, "_run", run)

    def __getattr__(self, name: str):
        if name not in SEEN:
            offers = ", ".join(SEEN)
            raise AttributeError(f"a callback's run has no {name!r}; it offers {offers} (docs/callbacks.md)")
        return getattr(self._run, name)

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"a callback's run is read-only (set {name!r}): callbacks must not change the run")


def stateful(obj) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class Callbacks:
    """The run's callbacks by name (`named`), in the config's order (`cfg.callbacks`)."""

    def __init__(self, nodes):
        got = (nodes or {}).items()
        self.named = {name: parts.build(node, f"callbacks.{name}") for name, node in got if node is not None}
        self.stopped_by: str | None = None  # "<name>: <why>", once a callback asked the run to stop

    def call(self, hook: str, run, *args) -> dict:
        """`hook` of each callback that has it, in order: {name: what it returned}."""
        methods = {name: getattr(callback, hook, None) for name, callback in self.named.items()}
        view = RunView(run)
        return {name: method(view, *args) for name, method in methods.items() if method is not None}

    def validation_end(self, run, record: dict) -> bool:
        """`on_validation_end` of each; True when one asked to stop (each is still called: all see the record)."""
        for name, answer in self.call("on_validation_end", run, record).items():
            if answer and self.stopped_by is None:
                self.stopped_by = f"{name}: {answer}" if isinstance(answer, str) else name
        return self.stopped_by is not None

    def state_dict(self) -> dict:
        return {name: obj.state_dict() for name, obj in self.named.items() if stateful(obj)}

    def load_state_dict(self, saved: dict, strict: bool) -> None:
        """The checkpoint's states back into the callbacks of the same names. A stateful callback missing here or
        new here is refused (resume_strict) or logged: the run would not go on as it was."""
        mine = {name for name, obj in self.named.items() if stateful(obj)}
        gone, new = sorted(saved.keys() - mine), sorted(mine - saved.keys())
        if gone or new:
            pairs = (("saved but not configured", gone), ("configured but not saved", new))
            what = "; ".join(f"{label}: {', '.join(names)}" for label, names in pairs if names)
            if strict:
                raise UserError(
                    f"resume: the checkpoint's callbacks with state differ from this run's ({what}): resume with the "
                    "same callbacks, or add resume_strict=false to go on (a new one starts fresh)"
                )
            log.warning("resume: callbacks with state changed (%s); resume_strict=false: a new one starts fresh", what)
        for name in sorted(mine & saved.keys()):
            self.named[name].load_state_dict(saved[name])
