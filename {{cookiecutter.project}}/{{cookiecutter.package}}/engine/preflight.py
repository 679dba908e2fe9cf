"""What a command checks before any work, once: `check`, train()'s first call, for every run and every job of a
multirun alike.

- `check_keys`, `precheck_data`: the checks that build nothing (every key known and in range, required values set,
  what the data sets tell unopened), each refusal one line (UserError) naming the key; then the run's model, task
  and data are built (run.build_problem: a `_target_` that cannot be imported or is given an argument it does not
  take is refused there, in one line naming both) and the dry step (dry_step.py) runs them once, its effects undone.
- Hydra writes nothing into the run folder (`hydra.output_subdir: null`): `record` writes its `.hydra/` files once
  the checks pass, so a refused command leaves a run it would go on untouched, and a folder it made is removed.
- `RunFolder` (`hydra.callbacks` in conf/config.yaml), before Hydra makes the run folder: one of the run's own
  (`claim`), the same for every torchrun rank.
- `one_line_errors` around train.py's `main()`: what Hydra reports over several lines as it composes, in one line.
"""

import dataclasses
import difflib
import itertools
import logging
import os
import pydoc
import re
from collections.abc import Callable
from pathlib import Path

from hydra.conf import HydraConf
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException, HydraException, MissingConfigException, OverrideParseException
from hydra.experimental.callback import Callback
from omegaconf import MISSING, DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from . import distributed, process, resume, run{% if cookiecutter.with_slurm == "yes" %}, slurm{% endif %}{% if cookiecutter.with_tracking == "yes" %}, tracking{% endif +%}
from .data_check import check_classes, own_draws
from .device import pick_device
from .dry_step import dry_step
from .errors import CodeError, UserError, first_line
from .schema import OPEN, SHIPPED, Config, Open, flatten

log = logging.getLogger("train")
HYDRA_FILES = ".hydra"  # where Hydra keeps a run's config (hydra.output_subdir): a folder that holds it is a run's


def check(cfg: DictConfig) -> tuple:
    """train()'s first call: `check_run` on every rank; a refusal is one line from rank 0 and exit code 2 (an error in
    your code: its traceback, then the line, exit 1), and removes the run folder this command claimed. Then the
    run's record (`record`)."""
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    world = error = None  # `check_run`'s result is only read when no rank failed
    try:
{% if cookiecutter.with_slurm == "yes" %}
        slurm.adopt_job_ranks()  # a submitit job of N tasks: one N-rank run, its ranks set as torchrun sets them
{% endif %}
        world = distributed.join_early(pick_device(cfg.device))  # joined already under torchrun (RunFolder)
        checked = check_run(cfg, run_dir, hydra_cfg.runtime.choices, list(hydra_cfg.overrides.task), world.is_main)
    except (UserError, CodeError) as e:
        error = (str(e), e.trace, 1 if isinstance(e, CodeError) else 2)
    errors = [error] if world is None else distributed.gather_all(error, world)  # every rank waits for all
    if first := next(filter(None, errors), None):
        if world is None or world.is_main:
            unclaim(run_dir)
        distributed.refuse(first[0], world, trace=first[1], code=first[2])
    if world.is_main:
        record(cfg, run_dir / HYDRA_FILES)
    return checked


def record(cfg: DictConfig, folder: Path) -> None:
    """The run's record, as Hydra writes it when its `output_subdir` is set: the config, Hydra's own, the overrides."""
    hydra_cfg = HydraConfig.get()
    folder.mkdir(exist_ok=True)
    OmegaConf.save(cfg, folder / "config.yaml")
    OmegaConf.save(OmegaConf.create({"hydra": hydra_cfg}), folder / "hydra.yaml")
    OmegaConf.save(hydra_cfg.overrides.task, folder / "overrides.yaml")


def unclaim(run_dir: Path) -> None:
    """A refused run's folder, when this command made it (its `.hydra` is still empty: `claim`), removed with its log
    file, and so are the parents it leaves empty inside the working folder (outputs/<day>/); a folder holding a run
    is left as it is."""
    try:
        (run_dir / HYDRA_FILES).rmdir()  # only when empty (or not there: nothing to remove)
    except OSError:
        return
    for log_file in run_dir.glob("*.log"):  # Hydra's job log, opened before train() runs
        log_file.unlink()
    folder, cwd = run_dir, Path.cwd()
    while folder != cwd and not any(folder.iterdir()) and (folder == run_dir or cwd in folder.parents):
        folder.rmdir()
        folder = folder.parent


def check_run(cfg: DictConfig, run_dir: Path, choices: dict, overrides: list[str], is_main: bool = True) -> tuple:
    """Every refusal a run can make before it starts, cheapest first: the keys and their ranges, then what shows
    without building anything (device=cuda with no GPU, the data sets' `precheck`,
    a resume's checkpoint), then the run's own build of its model, task and data (`run.build_problem`) and the dry
    step, which runs them once. Hands the run (unexact, resumed, problem, own_draws): the ops the dry step ran
    without a deterministic kernel (deterministic=warn); the checkpoint a resume continues, its path and contents
    read once, or None; the model, optimizer, task, callbacks and data, built once (run.Problem); the training
    data's generator of its own (data_check.own_draws: not exact), or None."""
    check_keys(cfg, choices, overrides)
    device = pick_device(cfg.device)
    precheck_data(cfg)
    resumed = resume.precheck(cfg, run_dir, is_main) if cfg.resume else None
    process.allocator(cfg)  # before the first large block: glibc tunes itself as blocks are freed
    problem = run.build_problem(cfg, device, resuming=resumed is not None)
    unexact = dry_step(cfg, problem, resumed[1] if resumed else None)
    draws = own_draws(problem.train_set, "data.train", cfg.seed, cfg.rng_mode.value == "per_sample")
    return unexact, resumed, problem, draws


class RunFolder(Callback):
    """train.py's run folder, before Hydra makes it: one of this run's own (`claim`), rank 0's for every torchrun
    rank; and a sweep under torchrun refused. eval.py's folders are Hydra's."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        if config.hydra.job.name != "train":
            return
        # Only run_job, after this, sets HydraConfig, which the `${hydra:...}` parts of hydra.run.dir need
        # (hydra-ecosystem/hydra#1301, #1884): set here as run_job does, or Hydra turns the error into a UserWarning
        # and skips this callback.
        HydraConfig.instance().set_config(config)
        # Under torchrun the ranks join their process group now, before anything is written: every rank takes the
        # folder rank 0 resolved (ranks resolving `${now:...}` each would split the run over two folders when their
        # starts straddle a second, hydra#2070).
        other_rank = os.environ.get("RANK", "0") != "0"  # the same config fails the same way on rank 0: it says so
        device = refusing(lambda: pick_device(config.device), quiet=other_rank)
        world = refusing(lambda: distributed.join_early(device))  # a rank without its GPU says so itself
        run_dir = asked = os.path.abspath(str(config.hydra.run.dir))
        explicit = any(o.startswith("hydra.run.dir=") for o in config.hydra.overrides.hydra)
        in_place = explicit and config.get("resume") and os.path.isdir(asked)  # going on in a run's folder
        if world.is_main and not in_place:  # a new folder is claimed, so that a refusal can remove it (`unclaim`)
            run_dir = claim(asked)
        run_dir = distributed.gather_all(run_dir, world)[0]  # rank 0's
        with read_write(config.hydra), open_dict(config.hydra):  # the folder run_job makes (if need be) and uses
            config.hydra.run.dir = run_dir
        if run_dir != asked and world.is_main:
            log.info("run folder %s holds another run: this one writes to %s", resume.short(asked),
                     resume.short(run_dir))  # fmt: skip

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        # Under torchrun every rank would run the whole sweep by itself, in sweep folders of their own (the time
        # straddling a second splits it), and the second job's process group cannot form where the first one's was.
        if config.hydra.job.name == "train" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            advice = "run one torchrun command per job, without -m"
{% if cookiecutter.with_slurm == "yes" %}
            advice += ", or sweep with hydra/launcher=submitit_slurm, its hydra.launcher.tasks_per_node the processes"
{% endif %}
            world = refusing(lambda: distributed.join_early(pick_device(config.device)))
            distributed.refuse(f"a sweep (-m) cannot run under torchrun: {advice}", world)


def refusing(work: Callable, quiet: bool = False):
    """`work()`, or its refusal as one `error:` line (none when `quiet`) and exit code 2."""
    try:
        return work()
    except UserError as e:
        distributed.refuse(str(e), quiet=quiet)


def claim(path: str) -> str:
    """A folder of this run's own: `path`, or `path-2`, `path-3`... when another run holds it (runs started in the
    same second resolve the same name: a shell loop, a SLURM array). A run holds a folder once it made its `.hydra`
    inside, and `os.mkdir` makes a folder or fails, atomically: two runs never share one, and an empty folder made
    beforehand is taken. `.hydra` stays empty until the run's checks pass (`record`)."""
    for n in itertools.count(1):
        folder = path if n == 1 else f"{path}-{n}"
        os.makedirs(folder, exist_ok=True)
        try:
            os.mkdir(os.path.join(folder, HYDRA_FILES))
        except FileExistsError:
            continue
        return folder


def one_line_errors(main: Callable) -> None:
    """Run Hydra's `main()`; a composition error becomes one `error:` line and exit code 2. HYDRA_FULL_ERROR (Hydra's
    documented switch) makes Hydra raise the error instead of printing its report and exiting 1."""
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    try:
        main()
    except (HydraException, OmegaConfBaseException) as e:
        GlobalHydra.instance().clear()  # the failed composition left Hydra initialised
        distributed.refuse(composition_error(e))


def composition_error(e: BaseException) -> str:
    """Hydra's composition error in one line; for an unknown key, the nearest one the schema (or Hydra's) has there."""
    cause = e.__cause__
    if isinstance(e, ConfigCompositionException) and isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
        key = cause.full_key  # an override of a key the config does not have
        parent, _, name = key.rpartition(".")
        where = "Hydra's own config" if key.startswith("hydra.") else None
        return unknown_key(f"{parent}." if parent else "", name, schema_keys(parent), where)
    if isinstance(e, MissingConfigException) and e.options:  # a group's option (its options listed) not found
        missing = e.missing_cfg_file
        group, _, choice = missing.rpartition("/")
        return f"{group}={choice}: there is no conf/{missing}.yaml; choose one of {', '.join(sorted(e.options))}"
    if isinstance(e, OverrideParseException):
        return f"cannot read the command line: {str(e).splitlines()[0]} (see Hydra's override grammar)"
    # Hydra's first line and OmegaConf's reason under it (a value of the wrong type): the libraries' own words
    return ": ".join(line for err in (e, cause) if err is not None and (line := first_line(err)))


def check_keys(cfg: DictConfig, choices: dict | None = None, overrides: list[str] | tuple = ()) -> None:
    """Refuse a bad config in one line (UserError), before any work. `choices`/`overrides` (Hydra's) make the
    message for a missing value name the file and the command."""
    raw = OmegaConf.to_container(cfg, resolve=False)  # unresolved: `${data.root}` is not `???`
    missing(raw, choices or {}, overrides)
    try:
        OmegaConf.to_container(cfg, resolve=True)
    except Exception as e:  # an interpolation to a key that is not there, a bad resolver
        raise UserError(f"config: {str(e).splitlines()[0]}") from None
    walk(cfg, Config, "")
{% if cookiecutter.with_tracking == "yes" %}
    tracking.check_packages(cfg)  # a logger whose package is missing: the line names the extra to install
{% endif %}
    added_data_keys(raw["data"], overrides)
    for name, node in raw["callbacks"].items():  # a dict: the schema's callback_nodes refused anything else
        if not (isinstance(node, dict) and isinstance(node.get("_target_"), str)):
            raise UserError(f"callbacks.{name} has no _target_: give it one, e.g. +callbacks.{name}._target_=<class>")


def schema_keys(path: str) -> list[str]:
    """The keys the schema (Hydra's own under `hydra.`) has at the dotted `path`; none in an open group (`model`)."""
    schema = Config
    for part in filter(None, path.split(".")):
        types = {f.name: f.type for f in dataclasses.fields(schema)}
        schema = HydraConf if (schema, part) == (Config, "hydra") else types.get(part)
        if not dataclasses.is_dataclass(schema):
            return []
    return [f.name for f in dataclasses.fields(schema)]


def did_you_mean(name: str, known, prefix: str) -> str:
    """The hint for a misspelt `name`: the closest of `known` (with its `prefix`), or "" if none is."""
    close = difflib.get_close_matches(name, known, n=1)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


def unknown_key(prefix: str, name: str, known, where: str | None = None) -> str:
    """The line for a key the schema (or `where`) does not have, with the nearest one it has there."""
    hint = did_you_mean(name, known, prefix)
    return f"unknown config key {prefix}{name}{hint}: {where or 'the schema in schema.py'} has no such key"


def missing(raw: dict, choices: dict, overrides) -> None:
    keys = sorted(key for key, value in flatten(raw).items() if value == MISSING)
    if not keys:
        return
    group = keys[0].split(".")[0]
    where = f"conf/{group}/{choices[group]}.yaml" if group in choices else "conf/config.yaml"
    command = " ".join(["python train.py", *overrides, *(f"{k}=<value>" for k in keys)])
    have, it = ("has", "it") if len(keys) == 1 else ("have", "them")
    raise UserError(f"{', '.join(keys)} {have} no value ('???' in {where}): set {it} on the command line: {command}")


def refuse_if(name: str, value, rule: Callable | None) -> None:
    """`rule` (a schema check) on `value`, a list or dict as plain Python (resolved); its refusal names `name`."""
    plain = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    if rule and (wanted := rule(plain)):
        raise UserError(f"{name} must be {wanted}, got {value!r}")


def walk(cfg, schema, prefix: str) -> None:
    """The config against the schema (schema.py), the one place of its keys' types and ranges: keys it does not have
    (Hydra refuses `loader.num_worker=3` but lets `+loader.num_worker=3` in), the range of each key it has, and
    the open groups' keys it describes."""
    known = {f.name: f for f in dataclasses.fields(schema)}
    for name in cfg:
        if name not in known:
            raise UserError(unknown_key(prefix, name, known))
    for f in known.values():
        if dataclasses.is_dataclass(f.type):  # a nested group: loader, checkpoint, ...
            walk(cfg[f.name], f.type, f"{prefix}{f.name}.")
        elif "open" in f.metadata:
            open_group(cfg, f"{prefix}{f.name}", f.metadata["open"])
        else:  # a key(): its check
            refuse_if(f"{prefix}{f.name}", cfg[f.name], f.metadata["check"])


def open_group(cfg, name: str, group: Open) -> None:
    """An open group's `_target_`s set, and its keys in range: the loop's whatever the target, the shipped targets'
    when its target is one of them."""
    for target in group.targets:
        if OmegaConf.select(cfg, f"{name}.{target}", default=None) is None:
            raise UserError(f"{name}.{target} is not set: the {name} group needs it (see conf/{name}/)")
    shipped = str(OmegaConf.select(cfg, f"{name}.{group.targets[0]}")).startswith(SHIPPED)
    for key, rule in [*group.loop.items(), *(group.shipped.items() if shipped else ())]:
        value = OmegaConf.select(cfg, f"{name}.{key}", default=MISSING)
        if value is not MISSING:
            refuse_if(f"{name}.{key}", value, rule)


def added_data_keys(data: dict, overrides) -> None:
    """data.* values reach the datasets through interpolations (`${data.root}`): a key added on the command line
    (`+data.per_clas=10`) that no node refers to, and that is not one the loop reads (the schema's data group), would
    be silently ignored, so it is refused. `data`: the data group, unresolved."""
    raw = str(data)
    for found in filter(None, (re.match(r"\+{1,2}data\.(\w+)=", override) for override in overrides)):
        key = found[1]
        ref = "${data." + key + "}"  # no f-string: the template engine reads its double braces
        if key not in OPEN["data"].loop and ref not in raw:
            hint = did_you_mean(key, [k for k in data if k != key], "data.")
            raise UserError(
                f"data.{key} is not used by data.train or data.val{hint}: remove it, or refer to it as {ref}"
            )


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
