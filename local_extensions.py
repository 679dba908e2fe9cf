"""Checks on the cookiecutter answers, run while cookiecutter renders them (the `__answers` entry of
cookiecutter.json): a refused answer stops generation with one `ERROR: ...` line, before anything is written.

Not a pre_gen_project hook: cookiecutter logs a failed hook with a traceback of its own. An exception
raised here is a FailedHookException, which cookiecutter's command line prints as one line (exit code 1)
and its Python API raises as it would for a hook.
"""
import keyword
import re
import sys

from cookiecutter.exceptions import FailedHookException
from jinja2.ext import Extension

# Imports the generated project relies on, plus its own top-level names (conf/, tests/, benchmarks/,
# train.py): a package with one of these names would shadow them. The template README lists the same.
TAKEN = {"torch", "torchvision", "hydra", "omegaconf", "numpy", "PIL", "tensorboard",
         "tqdm", "psutil", "pytest", "conf", "tests", "benchmarks", "train"}
# Compared case-insensitively: on macOS and Windows a `Json/` folder shadows `json`.
TAKEN_LOWER = {name.lower() for name in TAKEN | set(sys.stdlib_module_names)}


def derived(project: str) -> str:
    """The package name cookiecutter.json derives from the project when `package` is not given."""
    return project.lower().replace("-", "_").replace(".", "_").replace(" ", "_")


def usable(name: str) -> bool:
    return name.isidentifier() and not keyword.iskeyword(name) and name.lower() not in TAKEN_LOWER


def suggestion(project: str, package: str) -> str:
    """A package name from the project that passes every check, else my_trainer."""
    name = re.sub(r"\W", "_", project.lower()).strip("_").lstrip("0123456789_")
    return name if usable(name) and name != package else "my_trainer"


def refusal(project: str, package: str) -> str | None:
    """What is wrong with the answers, in one line, or None."""
    if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?", project):
        return (f"project {project!r} is not a valid directory/distribution name: use letters, "
                "digits, '-', '_' or '.', starting and ending with a letter or digit")
    if package.isidentifier() and not keyword.iskeyword(package) and package.lower() not in TAKEN_LOWER:
        return None
    if not package.isidentifier():
        why = "is not a Python identifier (letters, digits and '_', not starting with a digit)"
    elif keyword.iskeyword(package):
        why = "is a Python keyword and cannot be imported"
    else:
        why = "would shadow the standard library or an import the project uses"
    better = suggestion(project, package)
    if package == derived(project):
        return (f"package {package!r}, the import name derived from project {project!r}, {why}: "
                f"pass one with package=, e.g. cookiecutter <template> project={project} package={better}")
    return f"package {package!r} {why}: choose another, e.g. package={better}"


# The optional parts (cookiecutter.json), each `yes` or `no`: a `no` leaves that part's files, keys and docs out.
PARTS = ("with_tracking", "with_shards", "with_streams", "with_slurm", "with_benchmarks", "with_fsdp", "with_photos",
         "with_doctor")


def part_refusal(answers) -> str | None:
    for name in PARTS:
        if str(answers[name]) not in ("yes", "no"):
            return f"{name} {str(answers[name])!r} is neither yes nor no: answer {name}=yes or {name}=no"
    return None


def checked(answers) -> str:
    message = refusal(str(answers["project"]), str(answers["package"])) or part_refusal(answers)
    if message:
        raise FailedHookException(f"ERROR: {message}")
    return "ok"


class AnswerChecks(Extension):
    """Adds the `checked` filter that cookiecutter.json's `__answers` applies to the answers."""

    def __init__(self, environment):
        super().__init__(environment)
        environment.filters["checked"] = checked
