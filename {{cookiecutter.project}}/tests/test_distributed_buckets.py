"""DDP's gradient buckets (distributed.settle_buckets): with 3 ranks a resumed run is torch.equal to the run that went
on, which needs every process to all-reduce in the same bucket layout from its first step."""

import subprocess

import pytest

from tests import helpers
from tests.helpers import PROJECT, RNG_DATA, load_ckpt, read_jsonl, same_weights

# 200 samples, 16 per rank: 4 steps per epoch on 3 ranks; a checkpoint after every step.
DATA = [*RNG_DATA, "rng_mode=per_worker", "loader.num_workers=1", "epochs=1", "max_steps=3", "log_every_steps=1"]


def three_ranks(run_dir, *overrides, workaround: str) -> None:
    """train.py on 3 ranks under torchrun, to max_steps; workaround off: settle_buckets does nothing (tests/patched.py),
    DDP's buckets come as DDP makes them."""
    cmd = helpers.torchrun_cmd(run_dir, *DATA, *overrides, launcher_args=("--nproc_per_node=3",))
    if workaround == "off":
        at = cmd.index("train.py")
        cmd[at:at] = ["tests/patched.py", "{{ cookiecutter.package }}.engine.distributed:settle_buckets=noop"]
    proc = subprocess.run(cmd, cwd=PROJECT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("workaround", ["on", "off"])
def test_three_rank_resume_is_exact_with_the_buckets_fixed(tmp_path, workaround):
    """A run resumed from step 2 ends step 3 on the weights of the run that went on from there; the negative control
    (workaround off): DDP's first step in a new process uses its start layout, and the weights differ."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    three_ranks(straight, "checkpoint.every_steps=1", workaround=workaround)
    three_ranks(resumed, f"resume={straight}/checkpoints/step-00000002.pth", workaround=workaround)
    assert len(load_ckpt(resumed / "checkpoints/last.pth")["ranks"]) == 3
    assert [r["step"] for r in read_jsonl(resumed / "steps.jsonl")] == [3]  # it did resume, for one step
    assert same_weights(straight / "checkpoints/last.pth", resumed / "checkpoints/last.pth") == (workaround == "on")
