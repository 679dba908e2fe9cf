"""{{ cookiecutter.description }}

Yours, the problem: `tasks.py` (loss and metrics), `data.py` (data sets), `model.py` (models); add classes here or in
files of your own and name them in `conf/task/`, `conf/data/`, `conf/model/`. The tools and the engine that runs
them are listed in the README's "Layout" section.
"""

__version__ = "0.1.0"
