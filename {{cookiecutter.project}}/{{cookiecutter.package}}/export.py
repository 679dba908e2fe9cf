"""One plain weights file from any checkpoint of this project{% if cookiecutter.with_fsdp == "yes" %}, whole or sharded (parallel=fsdp){% endif %}:

    python -m {{ cookiecutter.package }}.export outputs/.../checkpoints/last.pth model.pth

OUT holds {"model": state_dict, "ema": state_dict} ("ema" only when the run kept an EMA), plain tensors on the CPU:
`torch.load(OUT, weights_only=True)` reads it, and so does `init_from=OUT`. Nothing is overwritten. The checkpoint is
read and refused as resume= reads it (engine/checkpoint.py), and written as atomically.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .engine import checkpoint
from .engine.errors import UserError


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__package__}.export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="a checkpoints/*.pth file{% if cookiecutter.with_fsdp == "yes" %} or sharded checkpoint folder{% endif %}")
    parser.add_argument("out", type=Path, help="the weights file to write")
    args = parser.parse_args(argv)
    try:
        if args.out.exists():
            raise UserError(f"export: {args.out} exists: give a new path (nothing was overwritten)")
        if not args.out.parent.is_dir():
            raise UserError(f"export: no folder {args.out.parent}: create it first")
        ckpt = checkpoint.load(args.checkpoint, {% if cookiecutter.with_fsdp == "yes" %}whole=True, {% endif %}who="export", latest=None)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    weights = {part: ckpt[part] for part in ("model", "ema") if ckpt.get(part) is not None}
    checkpoint.publish(weights, args.out)
    print(f"wrote {args.out}: {' and '.join(weights)} weights, {len(weights['model'])} tensors each")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
