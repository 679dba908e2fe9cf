#!/usr/bin/env bash
# GPU check, run by hand on a CUDA machine from the project root:  bash benchmarks/gpu_check.sh
# 1. For every loader profile, ResNet-18 on the shapes data (2 epochs each), with the device prefetch on and off
#    (device_prefetch: the next batch copied on a side stream during the step, or on the compute stream) and with
#    uint8 batches on and off (off: the workers convert to float32 and normalize, as a float pipeline would).
#    Prints each run's epoch-2 samples/s and data-wait share (time the loop stood waiting for the loader / epoch time).
# 2. A short training under torch.cuda.set_sync_debug_mode("warn"), listing every place the host waits for the GPU.
# 3. Exact resume on the GPU with deterministic=true: ResNet-18 stopped mid-epoch and resumed, compared with
#    torch.equal to the run that never stopped (and the dry step refuses any op without a deterministic kernel).
{% if cookiecutter.with_fsdp == "yes" %}
# 4. Exact resume under parallel=fsdp: model=vit sharded over the visible GPUs (2 at most; one GPU: a group of one),
#    stopped mid-epoch and resumed from its sharded checkpoint, compared through the export command.
{% endif %}
{% if cookiecutter.with_photos == "yes" %}
# {{ 5 if cookiecutter.with_fsdp == "yes" else 4 }}. JPEG decoding on the device: nvJPEG (torchvision.io.decode_jpeg, device="cuda", 64 files a call) against
#    libjpeg-turbo on one CPU thread, on the photos of benchmarks/p7_photos.py (the bench extra brings scikit-learn's);
#    then train.py's whole loader path on those photos, data.decode=gpu (workers read bytes, nvJPEG decodes each
#    batch after the copy) against data.decode=auto, images/s with the same 4 workers (WORKERS=8 to change them).
{% endif %}
# About 10 minutes on one GPU; the runs land in outputs/gpu_check/. EPOCHS=1 or PROFILES=balanced make it shorter.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
EPOCHS=${EPOCHS:-2}
PROFILES=${PROFILES:-"memory-tight balanced throughput"}
{% if cookiecutter.with_photos == "yes" %}
WORKERS=${WORKERS:-4}
{% endif %}
python_has_cuda=$($PY -c "import torch; print(int(torch.cuda.is_available()))")
[ "$python_has_cuda" = 1 ] || { echo "no CUDA device visible: this check needs a GPU" >&2; exit 1; }
out=outputs/gpu_check
rm -rf "$out" && mkdir -p "$out"

# uint8 off: the same augmentation, then ToDtype + Normalize in the workers (data.normalize passes floats through)
ToImage='{_target_: torchvision.transforms.v2.ToImage}'
to_float='{_target_: torchvision.transforms.v2.ToDtype, dtype: {_target_: hydra.utils.get_object, path: torch.float32},'
to_float+=' scale: true}, {_target_: torchvision.transforms.v2.Normalize,'
to_float+=' mean: [0.5, 0.5, 0.5], std: [0.25, 0.25, 0.25]}'
crop='{_target_: torchvision.transforms.v2.RandomResizedCrop, size: 32, scale: [0.6, 1.0], ratio: [0.8, 1.25],'
crop+=' antialias: true}'
flip='{_target_: torchvision.transforms.v2.RandomHorizontalFlip, p: 0.5}'
resize='{_target_: torchvision.transforms.v2.Resize, size: 32, antialias: true}'
center='{_target_: torchvision.transforms.v2.CenterCrop, size: 32}'
float_train="data.train.transform.transforms=[$ToImage, $crop, $flip, $to_float]"
float_val="data.val.transform.transforms=[$ToImage, $resize, $center, $to_float]"

for profile in $PROFILES; do
  for prefetch in true false; do
    for uint8 in true false; do
      extra=()
      [ "$uint8" = true ] || extra=("$float_train" "$float_val")
      run="$out/$profile-prefetch_$prefetch-uint8_$uint8"
      $PY train.py device=cuda model=resnet18 loader="$profile" device_prefetch="$prefetch" epochs="$EPOCHS" \
        progress=false "${extra[@]}" hydra.run.dir="$run" > "$out/last.log" 2>&1 || { cat "$out/last.log" >&2; exit 1; }
    done
  done
done
$PY - "$out" <<'PY'
import json, sys
from pathlib import Path
print(f"{'profile':<14} {'prefetch':<9} {'uint8':<6} {'samples/s':>10} {'data_wait_share':>15} {'pss_mib':>8}")
for run in sorted(p for p in Path(sys.argv[1]).iterdir() if p.is_dir()):
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    profile, rest = run.name.split("-prefetch_")
    prefetch, uint8 = rest.split("-uint8_")
    print(f"{profile:<14} {prefetch:<9} {uint8:<6} {last['samples_per_s']:>10.0f} {last['data_wait_share']:>15.3f} "
          f"{last['pss_mib']:>8.0f}")
PY
echo
$PY -m benchmarks.sync_report model=resnet18 epochs=1 hydra.run.dir="$out/sync_report" 2>"$out/sync_report.log" \
  || { tail -20 "$out/sync_report.log" >&2; exit 1; }

echo
# 3. exact on the GPU: a straight run against one stopped at step 7 (mid-epoch 0 of 2: 800 images, 12 steps an epoch)
#    and resumed
# Runs COMMAND... straight, stopped at step STOP, and resumed from that stop: $out/NAME-{straight,stopped,resumed}.
straight_stop_resume() {
  local name=$1 stop=$2
  shift 2
  "$@" hydra.run.dir="$out/$name-straight" > "$out/last.log" 2>&1 || { cat "$out/last.log" >&2; exit 1; }
  "$@" max_steps="$stop" hydra.run.dir="$out/$name-stopped" > "$out/last.log" 2>&1 \
    || { cat "$out/last.log" >&2; exit 1; }
  "$@" resume="$out/$name-stopped/checkpoints/last.pth" hydra.run.dir="$out/$name-resumed" > "$out/last.log" 2>&1 \
    || { cat "$out/last.log" >&2; exit 1; }
}
# Compares the "model" weights of two files (checkpoints or exports) with torch.equal; LABEL names the check.
same_model() {
  $PY - "$@" <<'PY'
import sys
import torch
label, first, second = sys.argv[1:]
a = torch.load(first, weights_only=True)["model"]
b = torch.load(second, weights_only=True)["model"]
same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
print(f"{label} on {torch.cuda.get_device_name()}: {'torch.equal' if same else 'DIFFERENT'} ({len(a)} tensors)")
sys.exit(0 if same else 1)
PY
}

exact=(device=cuda model=resnet18 deterministic=true data.root="$out/shapes-200" data.per_class=200 epochs=2)
exact+=(loader.batch_size=64 progress=false)
straight_stop_resume exact 7 $PY train.py "${exact[@]}"
same_model "exact resume" "$out/exact-straight/checkpoints/last.pth" "$out/exact-resumed/checkpoints/last.pth"

{% if cookiecutter.with_fsdp == "yes" %}
echo
# 4. exact under FSDP: the same comparison with sharded checkpoints, through python -m <package>.export
gpus=$($PY -c "import torch; print(min(torch.cuda.device_count(), 2))")
fsdp=(device=cuda parallel=fsdp model=vit optim=adamw optim.lr=0.002 deterministic=true data.root="$out/shapes-200")
fsdp+=(data.per_class=200 epochs=2 loader.batch_size=32 progress=false)
straight_stop_resume fsdp 9 $PY -m torch.distributed.run --standalone --nproc_per_node="$gpus" train.py "${fsdp[@]}"
for run in straight resumed; do
  $PY -m {{ cookiecutter.package }}.export "$out/fsdp-$run/checkpoints/last.pth" "$out/fsdp-$run.pth" > /dev/null
done
same_model "fsdp exact resume on $gpus GPUs" "$out/fsdp-straight.pth" "$out/fsdp-resumed.pth"
{% endif %}
{% if cookiecutter.with_photos == "yes" %}
echo
# {{ 5 if cookiecutter.with_fsdp == "yes" else 4 }}. gpu-decode vs cpu-decode, images/s, at 500 x 375 and 2048 x 1536; then the loader path, decode=gpu vs auto
$PY -m benchmarks.p7_photos --gpu
$PY -m benchmarks.p7_photos --loader --workers "$WORKERS"
{% endif %}
