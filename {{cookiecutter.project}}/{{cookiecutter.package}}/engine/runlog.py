"""What a run writes for people to read: `metrics.jsonl` (one line per epoch), `steps.jsonl` (one line per
`log_every_steps` optimizer steps: the mean loss over them and of each of a task's loss parts, `loss_<name>`),
TensorBoard event files under `tb/`{% if cookiecutter.with_tracking == "yes" %}, the jsonl lines as rows of `steps.csv` and `metrics.csv`, and the same
figures to the trackers of `logger.use` (MLflow, W&B: tracking.py){% endif %}."""

from __future__ import annotations

{% if cookiecutter.with_tracking == "yes" %}
import csv
{% endif %}
import json
{% if cookiecutter.with_tracking == "yes" %}
from collections.abc import Sequence
{% endif %}
from pathlib import Path

import torch
from torch.utils.tensorboard import SummaryWriter
{% if cookiecutter.with_tracking == "yes" %}

from .tracking import Tracking
{% endif %}


class RunLog:
    """Only one process writes (rank 0 under torchrun); for the others `enabled=False` makes every call a no-op.{% if cookiecutter.with_tracking == "yes" +%}
    `use`: logger.use, of which RunLog writes the run folder's (tensorboard, csv); `tracking`: the others'.{% endif %}"""

{% if cookiecutter.with_tracking == "yes" %}
    def __init__(
        self,
        run_dir: Path,
        purge_step: int | None = None,
        enabled: bool = True,
        tracking: Tracking | None = None,
        use: Sequence[str] = ("tensorboard",),
    ):
        self.enabled = enabled
        self.tracking = tracking
{% else %}
    def __init__(self, run_dir: Path, purge_step: int | None = None, enabled: bool = True):
        self.enabled = enabled
{% endif %}
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.files = {}  # steps.jsonl, metrics.jsonl
        for name in ("metrics", "steps"):
            path = run_dir / f"{name}.jsonl"
            if purge_step is not None and path.exists():  # resuming where a crashed run also wrote
                kept = [t for t in path.read_text().splitlines() if t and json.loads(t)["step"] < purge_step]
                path.write_text("".join(text + "\n" for text in kept))  # the lines past the checkpoint dropped
            self.files[name] = open(path, "a", buffering=1)
        self.tb = SummaryWriter(log_dir=str(run_dir / "tb"), purge_step=purge_step){% if cookiecutter.with_tracking == "yes" %} if "tensorboard" in use else None{% endif +%}
{% if cookiecutter.with_tracking == "yes" %}
        self.csv = run_dir if "csv" in use else None
        if self.csv is not None:  # the rows of the jsonl lines kept (a resume's purge)
            write_table(run_dir, "steps")
            write_table(run_dir, "metrics")
{% endif %}

    def step(self, step: int, lr: float, figures: dict) -> None:
        """One log interval: `lr` is the rate after `step`, `figures` EpochMeter.read_window's means over the steps
        since the previous line (`loss`, with optim.grad_clip `grad_norm` before clipping, a task's `loss_<name>`)."""
        if not self.enabled:
            return
        shown = {"loss": figures["loss"], "lr": lr, **figures}  # the line's order: loss, lr, grad_norm, parts
        line = {"step": step, **shown}
        self.files["steps"].write(json.dumps(line) + "\n")
        self.scalars("train", shown, step)
{% if cookiecutter.with_tracking == "yes" %}
        if self.csv is not None:
            write_table(self.csv, "steps", line)
        if self.tracking is not None:  # the same Python floats, queued: the step does not wait for a server
            self.tracking.log(step, {f"train/{key}": value for key, value in shown.items()})
{% endif %}

    def epoch(self, record: dict) -> None:
        if not self.enabled:
            return
        self.files["metrics"].write(json.dumps(record) + "\n")
        shown = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k not in ("epoch", "step")}
        self.scalars("epoch", shown, record["step"])
        if self.tb is not None:
            self.tb.flush()
{% if cookiecutter.with_tracking == "yes" %}
        if self.csv is not None:
            write_table(self.csv, "metrics")
        if self.tracking is not None:  # every number of the line (not mid_epoch's flag nor the worker pids)
            self.tracking.log(record["step"], {f"epoch/{k}": v for k, v in numbers(record).items() if k != "step"})
{% endif %}

    def image(self, tag: str, image: torch.Tensor, step: int) -> None:
        """A picture (3, H, W), values in [0, 1], on the CPU: TensorBoard{% if cookiecutter.with_tracking == "yes" %}, and the trackers of `logger.use`{% endif %}."""
        if not self.enabled:
            return
        picture = image.numpy()  # one conversion for every logger (TensorBoard would make its own)
        if self.tb is not None:
            self.tb.add_image(tag, picture, step)
            self.tb.flush()
{% if cookiecutter.with_tracking == "yes" %}
        if self.tracking is not None:
            self.tracking.log(step, {tag: (picture.transpose(1, 2, 0) * 255).round().astype("uint8")})
{% endif %}

    def hparams(self, params: dict, figures: dict) -> None:
        """The run's settings and final figures for TensorBoard's HParams tab, as the run `tb/hparams`."""
        if self.enabled and self.tb is not None:
            self.tb.add_hparams(params, figures, run_name="hparams")

    def scalars(self, group: str, values: dict, step: int) -> None:
        """TensorBoard only: the jsonl lines' figures, and e.g. the loader health samples under `health/`."""
        if not self.enabled or self.tb is None:
            return
        for key, value in values.items():
            self.tb.add_scalar(f"{group}/{key}", value, step)

{% if cookiecutter.with_tracking == "yes" %}
    def close(self, files: dict | None = None, finished: bool = False) -> None:
        """The files closed; the trackers get the checkpoint paths (`files`: last, best) and end their runs, as
        `finished` or stopped to be resumed (an exception too: what was queued is still sent)."""
        if not self.enabled or self.files["steps"].closed:
            return
        if self.tracking is not None:
            self.tracking.close(files or {}, finished)
{% else %}
    def close(self) -> None:
        if not self.enabled or self.files["steps"].closed:
            return
{% endif %}
        if self.tb is not None:
            self.tb.close()
        for file in self.files.values():
            file.close()
{% if cookiecutter.with_tracking == "yes" %}


def numbers(line: dict) -> dict:
    """A jsonl line's numbers (not mid_epoch's flag nor the worker pids)."""
    return {k: v for k, v in line.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def write_table(run_dir: Path, name: str, line: dict | None = None) -> None:
    """`<name>.csv`, the numbers of `<name>.jsonl`'s lines as rows: `line` appended under the file's header (steps.csv,
    a row per log line), else the file written whole from the jsonl file (metrics.csv, whose columns vary)."""
    path = run_dir / f"{name}.csv"
    if line is not None and path.exists():
        with open(path, newline="") as f:
            columns = next(csv.reader(f))
        with open(path, "a", newline="") as f:
            csv.DictWriter(f, columns, extrasaction="ignore").writerow(line)  # a steps line holds numbers only
        return
    rows = [numbers(json.loads(text)) for text in (run_dir / f"{name}.jsonl").read_text().splitlines() if text]
    if not rows:  # no header without a row: the first row's parts make the columns
        path.unlink(missing_ok=True)
        return
    # steps.csv: the fixed columns first, as the header that later rows go under
    lead = ("step", "loss", "lr", "grad_norm") if name == "steps" else ("step",)
    columns = list(dict.fromkeys([*lead, *(k for row in rows for k in row)]))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
{% endif %}
