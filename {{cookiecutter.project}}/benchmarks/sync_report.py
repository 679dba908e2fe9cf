"""Every place where training makes the host wait for the GPU: train.py under torch.cuda.set_sync_debug_mode("warn").

    python benchmarks/sync_report.py max_steps=60 hydra.run.dir=outputs/sync_report   # any train.py overrides

PyTorch warns at each synchronizing CUDA call (`item`, `tolist`, `cpu`, a `bool()` of a tensor, a copy to
pageable host memory...). Each warning is charged to the innermost line of this project that led to it,
and the lines are printed with their counts next to the optimizer steps taken, so a per-step sync shows
as a count close to the number of steps. What train.py should show: the log points (one per
`log_every_steps` steps), validation and the epoch's figures (one each per epoch), checkpoint writes, and
with amp=fp16 one per step in the GradScaler.
"""

import collections
import json
import runpy
import sys
import traceback
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("sync_report: no CUDA device visible; PyTorch only reports syncs of a GPU")
    syncs: collections.Counter = collections.Counter()
    show = warnings.showwarning

    def charge(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return show(message, category, filename, lineno, file, line)
        for frame in reversed(traceback.extract_stack()[:-1]):
            path = Path(frame.filename).resolve()
            if path.is_relative_to(ROOT) and path != Path(__file__).resolve():
                syncs[f"{path.relative_to(ROOT)}:{frame.lineno}  {frame.line}"] += 1
                return
        syncs["outside the project"] += 1

    warnings.showwarning = charge
    warnings.simplefilter("always")  # every occurrence, not the first per line
    torch.cuda.set_sync_debug_mode("warn")
    sys.argv = ["train.py", "device=cuda", "progress=false", *sys.argv[1:]]
    try:
        runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
    except SystemExit as e:
        if e.code:
            raise
    finally:
        torch.cuda.set_sync_debug_mode(0)
        run_dir = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("hydra.run.dir=")), None)
        steps_file = Path(run_dir) / "steps.jsonl" if run_dir else None
        logged = steps_file.read_text().splitlines() if steps_file and steps_file.exists() else []
        steps = json.loads(logged[-1])["step"] if logged else "?"
        print(f"synchronizing CUDA calls over {steps} optimizer steps, by the project line that made them:")
        for where, count in syncs.most_common():
            print(f"{count:>6}  {where}")
        print(f"{sum(syncs.values()):>6}  in all")


if __name__ == "__main__":
    main()
