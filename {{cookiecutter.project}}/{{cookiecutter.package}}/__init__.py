"""{{ cookiecutter.description }}

Yours, the problem: `tasks.py` (loss and metrics), `data.py` (data sets), `model.py` (models); add classes here or in
files of your own and name them in `conf/task/`, `conf/data/`, `conf/model/`. The tools and the engine that runs
them are listed in the README's "Layout" section.

What these files use of the engine, its public surface (the rest of `engine/` may change without notice):
- `engine.errors`: UserError, one `error:` line and exit code 2;
- `engine.rng`: seeding, `kept`; `engine.device`: a batch's tensors and parts, `to_device`;
- `engine.data_check`: a data set's first samples, its classes checked; `engine.files`: durable writes;
- `engine.schema`: the rules for a config value, `flatten`;
- `engine.checkpoint`: `improves`, the rule by which best.pth keeps an epoch (EarlyStopping judges by it too);
{% if cookiecutter.with_photos == "yes" %}
- `engine.decode`: CropDecoder;
{% endif %}
{% if cookiecutter.with_streams == "yes" %}
- `engine.shard_plan`: how a stream splits over readers;
{% endif %}
and a data set's optional members, the ones docs/data.md's table lists.
"""

__version__ = "0.1.0"
