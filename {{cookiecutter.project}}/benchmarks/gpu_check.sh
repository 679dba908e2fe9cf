#!/usr/bin/env bash
# GPU check, run by hand on a CUDA machine from the project root:  bash benchmarks/gpu_check.sh
# For every loader profile, ResNet-18 on the shapes data with pin_memory on and off (train.py always
# copies with non_blocking=True, which only overlaps the copy when the batch is pinned), 2 epochs each.
# Prints each run's epoch-2 data-wait share (time the GPU loop stood waiting for the loader / epoch time)
# and samples/s. A few minutes on one GPU; the runs land in outputs/gpu_check/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
python_has_cuda=$($PY -c "import torch; print(int(torch.cuda.is_available()))")
[ "$python_has_cuda" = 1 ] || { echo "no CUDA device visible: this check needs a GPU" >&2; exit 1; }
out=outputs/gpu_check
rm -rf "$out" && mkdir -p "$out"
for profile in memory-tight balanced throughput; do
  for pin in true false; do
    $PY train.py device=cuda model=resnet18 loader="$profile" loader.pin_memory="$pin" epochs=2 progress=false \
      hydra.run.dir="$out/$profile-pin_$pin" > "$out/last.log" 2>&1 || { cat "$out/last.log" >&2; exit 1; }
  done
done
$PY - "$out" <<'PY'
import json, sys
from pathlib import Path
print(f"{'profile':<14} {'pin':<6} {'data_wait_share':>15} {'samples/s':>10} {'pss_mib':>8}")
for run in sorted(p for p in Path(sys.argv[1]).iterdir() if p.is_dir()):
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    profile, pin = run.name.rsplit("-pin_", 1)
    print(f"{profile:<14} {pin:<6} {last['data_wait_share']:>15.3f} {last['samples_per_s']:>10.0f} {last['pss_mib']:>8.0f}")
PY
