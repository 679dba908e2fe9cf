"""The loop reads tensors back to the host once per log interval, not once per step.

Counted for real: train.py runs in a subprocess under tests/count_reads.py, which patches the tensor methods
that hand values to Python and charges each call to the project file that made it.
"""

import json
import math
import subprocess
import sys

import pytest

from tests.helpers import PROJECT, RNG_DATA, read_jsonl

# 256 samples in batches of 8: 32 steps per epoch, 64 in all
DATA = [*RNG_DATA, "data.train.size=256", "loader.batch_size=8", "epochs=2"]
STEPS, EPOCHS = 64, 2
LOOP = (
    "train.py",
    "{{ cookiecutter.package }}/engine/run.py",
    "{{ cookiecutter.package }}/engine/task_results.py",
    "{{ cookiecutter.package }}/engine/validation.py",
    "{{ cookiecutter.package }}/engine/device.py",
    "{{ cookiecutter.package }}/engine/runlog.py",
    "{{ cookiecutter.package }}/engine/epoch_meter.py",
    "{{ cookiecutter.package }}/engine/distributed.py",
    "{{ cookiecutter.package }}/engine/optim.py",
    "{{ cookiecutter.package }}/engine/ema.py",
)


def counted_runs(tmp_path, *variants) -> list[tuple[int, int]]:
    """(reads by the loop and validation, reads by everything else) per variant; the runs go side by side."""
    procs = []
    for i, overrides in enumerate(variants):
        cmd = [
            sys.executable,
            "tests/count_reads.py",
            str(tmp_path / f"reads-{i}.json"),
            *DATA,
            *overrides,
            f"hydra.run.dir={tmp_path / f'run-{i}'}",
        ]
        procs.append(subprocess.Popen(cmd, cwd=PROJECT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    results = []
    for i, proc in enumerate(procs):
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out[-3000:]
        assert read_jsonl(tmp_path / f"run-{i}" / "metrics.jsonl")[-1]["step"] == STEPS
        counts = json.loads((tmp_path / f"reads-{i}.json").read_text())
        loop = sum(n for where, n in counts.items() if where in LOOP)
        results.append((loop, sum(counts.values()) - loop))
    return results


@pytest.mark.slow
def test_host_reads_per_log_interval_not_per_step(tmp_path):
    knobs = ["log_every_steps=10", "optim.grad_clip=1.0", "ema.decay=0.9", "val_every_steps=50"]
    knobs += {% if cookiecutter.with_tracking == "yes" %}["logger=csv"]{% else %}[]{% endif %}  # a tracker's thread reads nothing either
    knobs.append("task._target_=tests.datasets.PartedClassification")  # its loss parts go in the same reads
    (default_loop, default_other), (every_loop, every_other), (knobs_loop, _) = counted_runs(
        tmp_path, ["log_every_steps=10"], ["log_every_steps=1"], knobs
    )
    intervals = math.ceil(STEPS / 10) + EPOCHS  # log points, plus each epoch's end closing an interval early
    # one read per log point, one for validation and one for the epoch's figures, and one start-up read (the
    # shipped callbacks on: the sample grid, converted once for every logger)
    assert default_loop <= intervals + 2 * EPOCHS + 1, default_loop
    # clipping's norm, the EMA, the loss parts and the non-finite check stay on the device, a tracker gets the floats
    # already read;
    # the mid-epoch validation at step 50 is a log point of its own (its read) and reads its figures once each
    assert knobs_loop <= intervals + 1 + 2 * (EPOCHS + 1) + 1, knobs_loop
    # the loader (sampler order, worker base seeds) and the checkpoints read a few CPU tensors per epoch, none per step
    assert default_other <= 6 * EPOCHS, default_other
    # negative control: logging every step reads every step
    assert every_loop >= STEPS, every_loop
    assert every_loop - default_loop >= STEPS - intervals
