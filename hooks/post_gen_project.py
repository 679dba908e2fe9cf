"""Drop what the answers leave out (LICENSE for license=none, each optional part answered `no`), then say what to
run next (cwd is the new project). The Jinja in the files does the rest."""
import shutil
from pathlib import Path

PROJECT, PACKAGE = {{ cookiecutter.project | tojson }}, {{ cookiecutter.package | tojson }}
LEFT_OUT = {
    "license": ["LICENSE"] if {{ cookiecutter.license | tojson }} == "none" else [],
    "with_tracking": [f"{PACKAGE}/engine/tracking.py", "conf/logger", "tests/test_tracking.py", "docs/tracking.md"],
    "with_shards": [f"{PACKAGE}/shards.py", "conf/data/shards.yaml", "tests/test_shards.py", "benchmarks/p6_shards.py",
                    "docs/shards.md"],
    "with_streams": [f"{PACKAGE}/stream.py", f"{PACKAGE}/engine/stream_loader.py", f"{PACKAGE}/engine/shard_plan.py",
                     "conf/data/jsonlines.yaml", "tests/test_stream.py", "tests/test_stream_loader.py",
                     "tests/test_stream_train.py", "tests/test_shard_plan.py", "docs/streams.md"],
    "with_slurm": [f"{PACKAGE}/engine/slurm.py", "conf/hydra", "tests/test_slurm.py", "docs/slurm.md"],
    "with_benchmarks": ["benchmarks", "docs/benchmarks.md"],
    "with_fsdp": [f"{PACKAGE}/engine/fsdp.py", "conf/parallel/fsdp.yaml",
                  "tests/test_fsdp.py", "tests/blocks.py", "benchmarks/p8_fsdp_memory.py"],
    "with_photos": [f"{PACKAGE}/engine/decode.py", "tests/test_gpu_decode.py", "benchmarks/p7_photos.py",
                    "docs/photos.md"],
    "with_doctor": [f"{PACKAGE}/doctor.py", "tests/test_doctor.py"],
}
ANSWERS = {
    "with_tracking": {{ cookiecutter.with_tracking | tojson }},
    "with_shards": {{ cookiecutter.with_shards | tojson }},
    "with_streams": {{ cookiecutter.with_streams | tojson }},
    "with_slurm": {{ cookiecutter.with_slurm | tojson }},
    "with_benchmarks": {{ cookiecutter.with_benchmarks | tojson }},
    "with_fsdp": {{ cookiecutter.with_fsdp | tojson }},
    "with_photos": {{ cookiecutter.with_photos | tojson }},
    "with_doctor": {{ cookiecutter.with_doctor | tojson }},
}
for part, paths in LEFT_OUT.items():
    if part == "license" or ANSWERS[part] == "no":
        for path in map(Path, paths):
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)

print(f"""
Generated {PROJECT}. Next steps:

    cd {PROJECT}
    pip install -e .    # or: pip install -r requirements.txt
    python train.py
    python train.py loader=memory-tight
    tensorboard --logdir outputs
""")
