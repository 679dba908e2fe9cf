"""What a command checks before any work, once: `check_run`, and where it runs.

- `check_keys`, `precheck_data`: the checks that build nothing (every key known and in range, required values set,
  every `_target_` importable and given only arguments it takes, what the data sets tell unopened), each refusal
  one line (UserError) naming the key; the dry step (dry_step.py) then builds and runs what the run will build.
- `CheckBeforeRun` (`hydra.callbacks` in conf/config.yaml) runs `check_run` for a single run before Hydra creates
  the run folder; `check_once` in train() for each job of a multirun (`-m`, sweeps, SLURM jobs).
- `one_line_errors` around train.py's `main()`: what Hydra reports over several lines as it composes, in one line.
"""

import contextlib
import dataclasses
import difflib
import inspect
import itertools
import logging
import os
import pydoc
import re
import sys
from collections.abc import Callable
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException, HydraException, OverrideParseException
from hydra.experimental.callback import Callback
from omegaconf import MISSING, DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from . import distributed, resume{% if cookiecutter.with_slurm == "yes" %}, slurm{% endif %}{% if cookiecutter.with_tracking == "yes" %}, tracking{% endif +%}
from .data_check import check_classes
from .device import pick_device
from .dry_step import dry_step
from .errors import UserError, reason
from .optim import LOOP_KEYS
from .schema import LOOP_OPEN_KEYS, OPEN_KEYS, Config, flatten

log = logging.getLogger("train")
HYDRA_FILES = ".hydra"  # where Hydra keeps a run's config (hydra.output_subdir): a folder that holds it is a run's

checked: dict[str, list[str]] = {}  # run folders check_run passed: the ops without a deterministic kernel it found
renamed: dict[str, str] = {}  # {run folder claimed: the one the config resolved, which another run holds}


def check_once(cfg: DictConfig) -> list[str]:
    """train()'s call: `check_run`, unless CheckBeforeRun ran it for this run already (a single run): one check per
    run either way. Returns the ops without a deterministic kernel the dry step found (deterministic=warn)."""
    hydra_cfg = HydraConfig.get()
    run_dir = hydra_cfg.runtime.output_dir
    if run_dir not in checked:
        check_run(cfg, Path(run_dir), hydra_cfg.runtime.choices, list(hydra_cfg.overrides.task))
    if run_dir in renamed:
        log.info("run folder %s holds another run: this one writes to %s", resume.short(renamed[run_dir]),
                 resume.short(run_dir))  # fmt: skip
    return checked[run_dir]


def check_run(cfg: DictConfig, run_dir: Path, choices: dict, overrides: list[str]) -> None:
    """Every refusal a run can make before it starts, cheapest first: the keys and their ranges, then what shows
    without building anything ({% if cookiecutter.with_slurm == "yes" %}SLURM tasks that cannot meet, {% endif %}device=cuda with no GPU, the data sets' `precheck`,
    a resume's checkpoint), then the dry step, which builds the data, model and task and runs them once."""
    check_keys(cfg, choices, overrides)
{% if cookiecutter.with_slurm == "yes" %}
    slurm.adopt_job_ranks()  # refuses N tasks that cannot meet (and exports the ranks, as train() does first)
{% endif %}
    pick_device(cfg.device)
    precheck_data(cfg)
    ckpt = resume.precheck(cfg, run_dir) if cfg.resume else None
    checked[str(run_dir)] = dry_step(cfg, ckpt)


class CheckBeforeRun(Callback):
    """`check_run` for train.py (not eval.py, whose config has keys of its own), exiting with its one line.

    Hydra writes `.hydra/config.yaml` and the log file into the run folder before it calls the task function, so a
    refusal from inside train() would already have overwritten a resumed run's saved config: a single run is checked
    in `on_run_start`, before anything is written. A multirun's jobs, each in a new folder, are train()'s to check."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        if config.hydra.job.name != "train":
            return
        # Only run_job, after this, sets HydraConfig, which the `${hydra:...}` parts of hydra.run.dir need
        # (hydra-ecosystem/hydra#1301, #1884): set here as run_job does, or Hydra turns the error into a UserWarning
        # and skips this check.
        HydraConfig.instance().set_config(config)
        task = config.copy()  # the task's config: without the `hydra` node, as the task function sees it
        with open_dict(task):
            del task["hydra"]
        # Under torchrun the ranks join their process group now, before anything is written: every rank takes the
        # folder rank 0 resolved (ranks resolving `${now:...}` each would split the run over two folders when their
        # starts straddle a second, hydra#2070), and rank 0 alone reports a refusal for all of them.
        other_rank = int(os.environ.get("RANK", "0")) != 0  # the same config fails the same way on rank 0: it says so
        device = self.refusing(lambda: pick_device(task.device), quiet=other_rank)
        world = self.refusing(lambda: distributed.join_early(device))  # a rank without its GPU says so itself
        run_dir = asked = os.path.abspath(str(OmegaConf.select(config, "hydra.run.dir")))
        explicit = any(o.split("=")[0] == "hydra.run.dir" for o in config.hydra.overrides.hydra)
        made = []  # the folders this command made, the run folder and any new parents, to remove on a refusal
        if world.is_main and not (explicit and task.get("resume")):  # going on in a folder takes both, explicitly
            run_dir, made = claim(asked)
        run_dir = distributed.gather_all(run_dir, world)[0]  # rank 0's
        with read_write(config.hydra), open_dict(config.hydra):  # the folder run_job makes (if need be) and uses
            config.hydra.run.dir = run_dir
            config.hydra.runtime.output_dir = run_dir  # as run_job sets it, so `${hydra:runtime.output_dir}` resolves
        HydraConfig.instance().set_config(config)
        if run_dir != asked:
            renamed[run_dir] = asked
        try:
            check_run(task, Path(run_dir), config.hydra.runtime.choices, list(config.hydra.overrides.task))
            error = None
        except UserError as e:
            error = str(e)
        first = next((e for e in distributed.gather_all(error, world) if e), None)  # every rank waits for all
        if first is not None:
            for folder in made:  # claimed a moment ago: empty, unless another run made a folder inside
                with contextlib.suppress(OSError):
                    os.rmdir(folder)
            refuse(first, world)

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        # Under torchrun every rank would run the whole sweep by itself, in sweep folders of their own (the time
        # straddling a second splits it), and the second job's process group cannot form where the first one's was.
        if config.hydra.job.name == "train" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            advice = "run one torchrun command per job, without -m"
{% if cookiecutter.with_slurm == "yes" %}
            advice += ", or sweep with hydra/launcher=submitit_slurm, its hydra.launcher.tasks_per_node the processes"
{% endif %}
            world = self.refusing(lambda: distributed.join_early(pick_device(config.device)))
            refuse(f"a sweep (-m) cannot run under torchrun: {advice}", world)

    @staticmethod
    def refusing(work: Callable, quiet: bool = False):
        """`work()`, or its refusal as one `error:` line (none when `quiet`) and exit code 2."""
        try:
            return work()
        except UserError as e:
            refuse(str(e), quiet=quiet)


def refuse(error: str, world: distributed.World | None = None, quiet: bool = False) -> None:
    """Exit with code 2, saying `error` in one line unless `quiet` (another rank says it). With `world`, every rank
    at once: rank 0 says it, and no rank exits before it has, since torchrun stops the other ranks as soon as one
    exits; the ranks then leave their group (a rank leaving a live gloo group as its peer exits can abort, SIGABRT)."""
    if not quiet and (world is None or world.is_main):
        print(f"error: {error}", file=sys.stderr, flush=True)
    if world is not None:
        distributed.gather_all(None, world)
        distributed.leave(world)
    sys.exit(2)


def claim(path: str) -> tuple[str, list[str]]:
    """A folder of this run's own: `path`, or `path-2`, `path-3`... when another run holds it (runs started in the
    same second resolve the same name: a shell loop, a SLURM array). A run holds a folder once it made its `.hydra`
    inside, and `os.mkdir` makes a folder or fails, atomically: two runs never share one, and an empty folder made
    beforehand is taken. Returns it and the folders made, deepest first, to remove should the run be refused."""
    for n in itertools.count(1):
        folder = path if n == 1 else f"{path}-{n}"
        made, missing = [], folder  # the folder and its parents that are not there yet, deepest first
        while not os.path.isdir(missing):
            made.append(missing)
            missing = os.path.dirname(missing)
        os.makedirs(folder, exist_ok=True)
        try:
            os.mkdir(os.path.join(folder, HYDRA_FILES))
        except FileExistsError:
            continue
        return folder, [os.path.join(folder, HYDRA_FILES), *made]


def one_line_errors(main: Callable, argv: list[str], config_dir: Path) -> None:
    """Run Hydra's `main()`; a composition error becomes one `error:` line and exit code 2. HYDRA_FULL_ERROR (Hydra's
    documented switch) makes Hydra raise the error instead of printing its report and exiting 1."""
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    try:
        main()
    except (HydraException, OmegaConfBaseException) as e:
        GlobalHydra.instance().clear()  # the failed composition left Hydra initialised
        refuse(composition_error(e, argv, config_dir))


def composition_error(e: BaseException, argv: list[str], config_dir: Path) -> str:
    """Hydra's composition error in one line; for an unknown key, the nearest known one (in the config composed
    without it)."""
    cause = e.__cause__
    if isinstance(e, ConfigCompositionException) and isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
        key = cause.full_key  # an override of a key the config does not have
        parent, _, name = key.rpartition(".")
        rest_argv = [a for a in argv if not a.startswith((key + "=", "-"))]
        try:
            with initialize_config_dir(str(Path(config_dir).resolve()), version_base="1.3", job_name="train"):
                rest = compose("config", overrides=rest_argv, return_hydra_config=True)
            node = OmegaConf.select(rest, parent) if parent else rest
            known = list(node) if OmegaConf.is_dict(node) else []
        except Exception:  # the other overrides fail too: no suggestion, the error still says which key
            known = []
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {parent + '.' if parent else ''}{close[0]}?)" if close else ""
        where = "Hydra's own config" if key.startswith("hydra.") else "the schema in schema.py"
        return f"unknown config key {key}{hint}: {where} has no such key"
    options = getattr(e, "options", None)
    missing = getattr(e, "missing_cfg_file", None)
    if options and missing and "/" in missing:
        group, _, choice = missing.rpartition("/")
        return f"{group}={choice}: there is no conf/{missing}.yaml; choose one of {', '.join(sorted(options))}"
    if isinstance(e, OverrideParseException):
        return f"cannot read the command line: {str(e).splitlines()[0]} (see Hydra's override grammar)"
    # Hydra's first line and OmegaConf's reason under it (a value of the wrong type): the libraries' own words
    return ": ".join(str(err).strip().splitlines()[0] for err in (e, cause) if err is not None and str(err).strip())


def check_keys(cfg: DictConfig, choices: dict | None = None, overrides: list[str] | None = None) -> None:
    """Refuse a bad config in one line (UserError), before any work. `choices`/`overrides` (Hydra's) make the
    message for a missing value name the file and the command."""
    missing(cfg, choices or {}, overrides or [])
    try:
        OmegaConf.to_container(cfg, resolve=True)
    except Exception as e:  # an interpolation to a key that is not there, a bad resolver
        raise UserError(f"config: {str(e).splitlines()[0]}") from None
    unknown(cfg, Config, "")
{% if cookiecutter.with_tracking == "yes" %}
    tracking.check_packages(cfg)  # a logger whose package is missing: the line names the extra to install
{% endif %}
    for name in (*TARGET_KEYS.values(), "data.val._target_"):
        if OmegaConf.select(cfg, name, default=None) is None:
            group = name.split(".")[0]
            raise UserError(f"{name} is not set: the {group} group needs it (see conf/{group}/)")
    shipped = {group for group, name in TARGET_KEYS.items() if str(OmegaConf.select(cfg, name)).startswith(SHIPPED)}
    for name, rule in {**OPEN_KEYS, **LOOP_OPEN_KEYS}.items():  # the loop's keys whatever the group's target
        value = OmegaConf.select(cfg, name, default=MISSING)
        if value is not MISSING and (name in LOOP_OPEN_KEYS or name.split(".")[0] in shipped):
            refuse_if(name, value, rule)
    added_data_keys(cfg, overrides or [])
    raw = OmegaConf.to_container(cfg, resolve=False)
    raw["optim"] = {k: v for k, v in raw["optim"].items() if k not in LOOP_KEYS}  # the loop's, not the optimizer's
    for name, node in (raw.get("callbacks") or {}).items():
        if not (isinstance(node, dict) and isinstance(node.get("_target_"), str)):
            raise UserError(f"callbacks.{name} has no _target_: give it one, e.g. +callbacks.{name}._target_=<class>")
    targets(raw, "")


# The `_target_` of each group whose keys depend on it (schema.py's open fields; data: its train data set's). A
# group's keys in OPEN_KEYS are checked when its target is one this project ships: yours may mean otherwise.
TARGET_KEYS = {"data": "data.train._target_", **{g: f"{g}._target_" for g in ("model", "optim", "task", "schedule")}}
SHIPPED = (f"{__name__.split('.')[0]}.", "torch.optim.", "torchvision.")  # this package's, torch's optimizers


def missing(cfg, choices: dict, overrides: list[str]) -> None:
    leaves = flatten(OmegaConf.to_container(cfg, resolve=False))  # unresolved: `${data.root}` is not `???`
    keys = sorted(key for key, value in leaves.items() if value == MISSING)
    if not keys:
        return
    group = keys[0].split(".")[0]
    where = f"conf/{group}/{choices[group]}.yaml" if group in choices else "conf/config.yaml"
    command = " ".join(["python train.py", *overrides, *(f"{k}=<value>" for k in keys)])
    have, it = ("has", "it") if len(keys) == 1 else ("have", "them")
    raise UserError(f"{', '.join(keys)} {have} no value ('???' in {where}): set {it} on the command line: {command}")


def refuse_if(name: str, value, rule: Callable | None) -> None:
    wanted = rule(value) if rule is not None else None
    if wanted:
        raise UserError(f"{name} must be {wanted}, got {value!r}")


def unknown(cfg, schema, prefix: str) -> None:
    """Keys the schema does not have (Hydra refuses `loader.num_worker=3` but lets `+loader.num_worker=3` in), and
    the range of each key it has."""
    known = {f.name: f for f in dataclasses.fields(schema)}
    for name in cfg:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
            raise UserError(f"unknown config key {prefix}{name}{hint}: the schema in schema.py has no such key")
    for f in known.values():
        if dataclasses.is_dataclass(f.type):  # a nested group: loader, checkpoint, ...
            unknown(cfg[f.name], f.type, f"{prefix}{f.name}.")
        elif "check" in f.metadata:
            refuse_if(prefix + f.name, cfg[f.name], f.metadata["check"])


# data.* keys the loop reads itself (run.py), besides the data sets' own `${data.<key>}` values
LOOP_DATA_KEYS = ("num_classes", "normalize", "collate", "batch_transform", "on_bad_sample", "input"{% if cookiecutter.with_streams == "yes" %}, "stream_resume"{% endif %})


def added_data_keys(cfg, overrides: list[str]) -> None:
    """data.* values reach the datasets through interpolations (`${data.root}`): a key added on the command line
    (`+data.per_clas=10`) that no node refers to would be silently ignored, so it is refused."""
    raw = str(OmegaConf.to_container(cfg.data, resolve=False))
    for override in overrides:
        found = re.match(r"\+{1,2}data\.(\w+)=", override)
        if found and found[1] not in LOOP_DATA_KEYS and "${data." + found[1] + "}" not in raw:
            close = difflib.get_close_matches(found[1], [k for k in cfg.data if k != found[1]], n=1)
            hint = f" (did you mean data.{close[0]}?)" if close else ""
            raise UserError(
                f"data.{found[1]} is not used by data.train or data.val{hint}: "
                "remove it, or refer to it as ${data." + found[1] + "}"
            )


def targets(tree, prefix: str) -> None:
    """Every `_target_` names something importable (a typo would otherwise fail only when that node is built), and
    every other key of its node is an argument the target takes: a class of yours may take any arguments, so they
    are checked against its signature (a target taking **kwargs takes anything)."""
    if isinstance(tree, list):
        tree = dict(enumerate(tree))
    if not isinstance(tree, dict):
        return
    target = tree.get("_target_")
    if isinstance(target, str):
        try:  # as Hydra's instantiate finds it: the longest importable module prefix, then attributes
            found = pydoc.locate(target)  # None: no such module or attribute
        except pydoc.ErrorDuringImport as e:  # a module that exists failed to import something
            raise UserError(f"{prefix}_target_={target} cannot be imported: {reason(e.value)}") from None
        if found is None:
            raise UserError(f"{prefix}_target_={target} cannot be imported: no module or attribute of that name")
        try:
            parameters = inspect.signature(found).parameters.values()
        except (TypeError, ValueError):  # a builtin without a signature: nothing to check against
            parameters = None
        if parameters is not None and not any(p.kind is p.VAR_KEYWORD for p in parameters):
            takes = [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
            for name in tree:
                if not (name.startswith("_") and name.endswith("_")) and name not in takes:
                    close = difflib.get_close_matches(name, takes, n=1)
                    hint = f"did you mean {prefix}{close[0]}? " if close else ""
                    raise UserError(
                        f"{prefix}{name} is not an argument of {target} ({hint}it takes {', '.join(takes) or 'none'})"
                    )
    for name, value in tree.items():
        targets(value, f"{prefix}{name}.")


def precheck_data(cfg) -> None:
    """The data errors that show without opening the data sets: each `data.<split>._target_` with a `precheck` (as the
    shipped data sets have) is called with the node's plain arguments (`check_keys` checked them) and returns the
    class names it will find, or None; a data set of yours gets the same early refusal by giving it one."""
    found = {}
    for split in ("train", "val"):
        node = cfg.data.get(split)
        precheck = getattr(pydoc.locate(node._target_), "precheck", None) if OmegaConf.is_dict(node) else None
        if precheck is not None:
            args = OmegaConf.to_container(node, resolve=True)
            args = {k: v for k, v in args.items() if k != "_target_" and not (isinstance(v, dict) and "_target_" in v)}
            found[split] = precheck(**args)
    check_classes(found, cfg.data.get("num_classes"))
