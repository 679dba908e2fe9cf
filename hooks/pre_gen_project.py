"""Refuse answers that would generate a broken project; nothing is generated then.

Cookiecutter renders this file with Jinja before running it. `tojson` turns each
answer into a valid Python string literal whatever quotes or backslashes it holds.
"""
import keyword
import re
import sys

PROJECT = {{ cookiecutter.project | tojson }}
PACKAGE = {{ cookiecutter.package | tojson }}

# Imports the generated project relies on, plus its own top-level names
# (conf/, tests/, benchmarks/, train.py): a package with one of these names would shadow them.
TAKEN = {"torch", "torchvision", "hydra", "omegaconf", "numpy", "PIL", "tensorboard",
         "tqdm", "psutil", "pytest", "conf", "tests", "benchmarks", "train"} | set(sys.stdlib_module_names)
# Compared case-insensitively: on macOS and Windows a `Json/` folder shadows `json`.
TAKEN_LOWER = {name.lower() for name in TAKEN}


def fail(message):
    print(f"ERROR: {message}", file=sys.stderr)
    sys.exit(1)


def suggestion():
    """A package name derived from the project that passes every check, else my_trainer."""
    name = re.sub(r"\W", "_", PROJECT.lower()).strip("_")
    ok = name.isidentifier() and not keyword.iskeyword(name) and name not in TAKEN_LOWER
    return name if ok and name != PACKAGE else "my_trainer"


if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?", PROJECT):
    fail(f"project {PROJECT!r} is not a valid directory/distribution name: use letters, "
         "digits, '-', '_' or '.', starting with a letter or digit")

if not PACKAGE.isidentifier():
    fail(f"package {PACKAGE!r} is not a Python identifier: use letters, digits and '_', "
         f"not starting with a digit; choose another package name such as {suggestion()}")

if keyword.iskeyword(PACKAGE):
    fail(f"package {PACKAGE!r} is a Python keyword and cannot be imported; "
         f"choose another package name such as {suggestion()}")

if PACKAGE.lower() in TAKEN_LOWER:
    fail(f"package {PACKAGE!r} would shadow the standard library or an import the project "
         f"uses; choose another package name such as {suggestion()}")
