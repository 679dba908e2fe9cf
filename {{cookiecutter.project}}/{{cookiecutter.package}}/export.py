"""One plain weights file from any checkpoint of this project{% if cookiecutter.with_fsdp == "yes" %}, whole or sharded (parallel=fsdp){% endif %}:

    python -m {{ cookiecutter.package }}.export outputs/.../checkpoints/last.pth model.pth

OUT holds {"model": state_dict, "ema": state_dict} ("ema" only when the run kept an EMA), plain tensors on the CPU:
`torch.load(OUT, weights_only=True)` reads it, and so does `init_from=OUT`. Nothing is overwritten.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from .engine import checkpoint
from .engine.errors import UserError


def export(source: Path, out: Path) -> dict:
    """Write `source`'s weights to `out` (atomically: a temp file renamed into place); returns what was written."""
    if out.exists():
        raise UserError(f"export: {out} exists: give a new path (nothing was overwritten)")
    if not out.parent.is_dir():
        raise UserError(f"export: no folder {out.parent}: create it first")
    try:
        ckpt = checkpoint.{% if cookiecutter.with_fsdp == "yes" %}full{% else %}load{% endif %}(source)
    except UserError as e:
        raise UserError(str(e).replace("resume: ", "export: ", 1)) from None
    weights = {"model": ckpt["model"]}
    if ckpt.get("ema") is not None:
        weights["ema"] = ckpt["ema"]
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(weights, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)
    return weights


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__package__}.export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="a checkpoints/*.pth file{% if cookiecutter.with_fsdp == "yes" %} or sharded checkpoint folder{% endif %}")
    parser.add_argument("out", type=Path, help="the weights file to write")
    args = parser.parse_args(argv)
    try:
        weights = export(args.checkpoint, args.out)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    parts = " and ".join(weights)
    print(f"wrote {args.out}: {parts} weights, {len(weights['model'])} tensors each")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
