"""P8: what parallel=fsdp keeps on each rank, measured: peak resident memory per rank on the CPU (gloo) at 2 and 4
ranks, over the same command with a tiny model.

    python -m benchmarks.p8_fsdp_memory [--ranks 2 4] [--width 1024] [--blocks 16] [--rounds 1]

The model is tests/blocks.py's BlockNet, a user's own residual MLP blocks (LayerNorm, Linear up to twice the width,
Linear down), each block an FSDP unit: at width 1,024 and 16 blocks about 270 MiB of float32 parameters. AdamW, two
optimizer steps, no loader workers. Fully sharded, parameters, gradients and AdamW's two moments are 4 x 270 MiB over
the ranks. Each rank's peak comes from the run's own log line (engine/fsdp.py's PeakMemory, getrusage); the bare run
is the same command at width 16. A figure per rank is that rank's peak minus the bare run's peak of the same rank.
"""

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEAK = re.compile(r"measured peak per rank over the run: resident ([\d, ]+) MiB")


def peaks(ranks: int, width: int, blocks: int) -> list[float]:
    """Each rank's peak resident MiB over a two-step run of BlockNet(width, blocks) on `ranks` gloo ranks."""
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", "train.py",
            "parallel=fsdp", "model._target_=tests.blocks.BlockNet", "+model.image_size=${data.image_size}",
            f"++model.width={width}", f"++model.blocks={blocks}", "parallel.shard_modules=[tests.blocks.ResidualBlock]",
            "optim=adamw", "max_steps=2", "loader.num_workers=0", "loader.batch_size=8", "progress=false",
            "checkpoint.keep=0", f"hydra.run.dir={run_dir}",
        ]  # fmt: skip
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    found = PEAK.findall(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not found:
        sys.exit(f"error: the {ranks}-rank run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return [float(v) for v in found[-1].split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=1, help="repeat each measurement; the median counts")
    args = parser.parse_args()
    params = args.blocks * (4 * args.width**2 + 5 * args.width) * 4 / 2**20
    print(f"P8 fsdp memory: BlockNet {args.blocks} blocks of width {args.width} (~{params:.0f} MiB of block "
          f"parameters), AdamW, 2 steps, CPU gloo; MiB per rank over the bare run (width 16)")  # fmt: skip
    print(f"{'ranks':>5} {'fully sharded':>14} {'measured, each rank':>28} {'max':>6}")
    over = {}
    for ranks in args.ranks:
        rounds = [
            [big - bare for big, bare in zip(peaks(ranks, args.width, args.blocks), peaks(ranks, 16, args.blocks))]
            for _ in range(args.rounds)
        ]
        each = [statistics.median(r[i] for r in rounds) for i in range(ranks)]
        over[ranks] = max(each)
        spread = f" (rounds: {', '.join(f'{max(r):.0f}' for r in rounds)})" if args.rounds > 1 else ""
        shown = ", ".join(f"{v:.0f}" for v in each)
        print(f"{ranks:>5} {4 * params / ranks:>14.0f} {shown:>28} {over[ranks]:>6.0f}{spread}")
    if len(over) > 1:
        low, high = min(over), max(over)
        print(f"from {low} to {high} ranks the per-rank figure drops by {1 - over[high] / over[low]:.0%}")


if __name__ == "__main__":
    main()
