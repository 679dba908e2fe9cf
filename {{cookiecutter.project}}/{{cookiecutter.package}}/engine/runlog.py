"""What a run writes for people to read: `metrics.jsonl` (one line per epoch), `steps.jsonl` (one line per
`log_every_steps` optimizer steps: the mean loss over them and of each of a task's loss parts, `loss_<name>`),
TensorBoard event files under `tb/`{% if cookiecutter.with_tracking == "yes" %}, the jsonl lines as rows of `steps.csv` and `metrics.csv`, and the same
figures to the trackers of `logger.use` (MLflow, W&B: tracking.py){% endif %}."""

from __future__ import annotations

{% if cookiecutter.with_tracking == "yes" %}
import csv
{% endif %}
import json
import time
{% if cookiecutter.with_tracking == "yes" %}
from collections.abc import Sequence
{% endif %}
from pathlib import Path

try:
    import resource
except ImportError:  # Windows
    resource = None

import torch
from torch.utils.tensorboard import SummaryWriter

from .device import sum_and_read
from .errors import UserError
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


class EpochMeter:
    """One epoch's running figures: sums on the device, read at log points only (a read makes the host wait for the
    device); the data wait and the sample count are host numbers. `carried`: the sums over ranks before a mid-epoch
    checkpoint (`state()`), so a resumed run logs the figures of the run that never stopped."""

    def __init__(self, device: torch.device, carried: dict | None = None):
        self.device = device
        zero = torch.zeros((), dtype=torch.float64, device=device)
        self.epoch_loss = zero.clone()  # sum of loss x batch size over the epoch
        self.window_loss = zero.clone()  # sum of micro-batch losses since the last read
        self.window_norm = zero.clone()  # sum of gradient norms (before clipping) since the last read
        self.first_bad = zero.clone()  # first step with a non-finite loss (float64 holds any step exactly)
        self.window_parts = {}  # sums (device tensors) of a task's loss parts since the last read, by name
        self.window_batches = 0
        self.window_norms = 0
        self.samples = 0
        self.batches = 0
        self.data_wait = 0.0
        self.carried = carried or {"window": NO_WINDOW, "epoch": {"loss": 0.0, "samples": 0}}
        self.started = time.perf_counter()
        self._faults_at_start = minor_page_faults()

    def timed(self, batches):
        """`batches`, adding the time the loop stood still waiting for each one to `data_wait`."""
        waiting_since = self.started
        for batch in batches:
            self.data_wait += time.perf_counter() - waiting_since
            yield batch
            waiting_since = time.perf_counter()

    def add(self, loss: torch.Tensor, grad_norm: torch.Tensor | None, parts: dict, n: int, step: int) -> None:
        """One micro-batch's loss (and, on an optimizer step with clipping on, the norm; the task's loss parts), `n`
        the samples the loader collated into it, `step` the optimizer step it belongs to; all device work, no read."""
        if self.window_parts.keys() != parts.keys() and (self.window_parts or self.batches):
            # every rank packs the same parts in the same order for the one all-reduce of a log point
            raise UserError(
                f"task loss() returned parts {sorted(parts)} at step {step}, {sorted(self.window_parts)} before: "
                "return the same part names on every step"
            )
        for name, part in parts.items():
            self.window_parts[name] = self.window_parts.get(name, 0) + part.double()
        loss = loss.double()
        self.window_loss += loss
        self.epoch_loss += loss * n
        self.first_bad.masked_fill_((self.first_bad == 0) & ~torch.isfinite(loss), step)
        if grad_norm is not None:
            self.window_norm += grad_norm.double()
            self.window_norms += 1
        self.window_batches += 1
        self.samples += n
        self.batches += 1

    def _sums(self, world, *more) -> tuple[dict, dict, list[float]]:
        """(the window's sums and counts over ranks, the epoch's, `more` summed over ranks), with what was carried
        in: one host read. Sums of float32 losses in float64 are exact, so they add up the same in any grouping."""
        names = sorted(self.window_parts)
        loss, norm, epoch_loss, samples, *rest = sum_and_read(
            [
                self.window_loss,
                self.window_norm,
                self.epoch_loss,
                self.samples,
                *map(self.window_parts.get, names),
                *more,
            ],
            self.device,
            world,
        )
        parts = dict(zip(names, rest))  # the parts, then `more`
        rest = rest[len(names) :]
        window = self.carried["window"]
        epoch = self.carried["epoch"]
        window = {
            "loss": window["loss"] + loss,
            "batches": window["batches"] + world.world_size * self.window_batches,
            "norm": window["norm"] + norm,
            "norms": window["norms"] + world.world_size * self.window_norms,
            "parts": {n: window["parts"].get(n, 0.0) + parts.get(n, 0.0) for n in sorted({*window["parts"], *parts})},
        }
        return window, {"loss": epoch["loss"] + epoch_loss, "samples": epoch["samples"] + round(samples)}, rest

    def read_window(self, stop_requested: bool, world, keep: bool = False) -> tuple[dict, int, bool]:
        """({loss, grad_norm when clipping is on, loss_<part>}: means since the last read, over ranks; the first step
        with a non-finite loss (0: none); whether any rank was asked to stop): one host read. `keep`: the window
        goes on (a stop off the log interval: the resumed run's next line covers the same steps)."""
        bad = self.first_bad > 0  # whether this rank diverged: sum_and_read counts it as 1.0
        window, _, (bad_step_sum, bad_ranks, signalled) = self._sums(world, self.first_bad, bad, stop_requested)
        batches = max(window["batches"], 1)
        figures = {"loss": window["loss"] / batches}
        if window["norms"]:
            figures["grad_norm"] = window["norm"] / window["norms"]
        figures.update({f"loss_{name}": total / batches for name, total in window["parts"].items()})
        if not keep:
            self.window_parts = dict.fromkeys(self.window_parts, 0)  # the names stay: the next window brings the same
            self.window_loss.zero_()
            self.window_norm.zero_()
            self.window_batches = self.window_norms = 0
            self.carried = {**self.carried, "window": NO_WINDOW}
        first_bad = round(bad_step_sum / bad_ranks) if bad_ranks else 0  # ranks that diverged, their mean step
        return figures, first_bad, signalled > 0

    def state(self, world) -> dict:
        """The running sums over ranks, for a mid-epoch checkpoint: one host read, a collective."""
        window, epoch, _ = self._sums(world)
        return {"window": window, "epoch": epoch}

    def training_time(self) -> tuple[float, float | None]:
        """The seconds of training since the epoch started and this process's minor page faults per batch (None where
        there is no getrusage), taken before a validation adds its own."""
        faults = minor_page_faults()
        per_batch = (faults - self._faults_at_start) / self.batches if faults is not None and self.batches else None
        return time.perf_counter() - self.started, per_batch

    def read_epoch(self, seconds: float, stop_requested: bool, world) -> tuple[float, float, bool]:
        """(train_loss over the epoch so far, samples/s over its `seconds` of training in this process, whether any
        rank was asked to stop): one host read."""
        _, epoch, (rate, signalled) = self._sums(world, self.samples / seconds, stop_requested)
        return epoch["loss"] / max(epoch["samples"], 1), rate, signalled > 0


NO_WINDOW = {"loss": 0.0, "batches": 0, "norm": 0.0, "norms": 0, "parts": {}}


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
def minor_page_faults() -> int | None:
    """This process's minor page faults so far, all threads (None where there is no getrusage): a step that
    faults thousands of times is taking back memory its allocator gave away (engine/process.py)."""
    return None if resource is None else resource.getrusage(resource.RUSAGE_SELF).ru_minflt
