"""P4: loader samples/s with loader=throughput vs (usable CPUs x the rate of one process loading alone).

    python -m benchmarks.p4_scaling

The single-process rate is TrainLoader with num_workers=0 and one torch thread: one core's worth
of decoding and augmenting. The throughput profile then runs one worker per usable CPU (prefetch 4,
persistent). Perfect scaling gives 1.0; the main process's own share of the work (receiving
batches, collating nothing but bookkeeping) and the OS take the rest.
"""

from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from benchmarks.common import samples_per_s, train_transform
from {{ cookiecutter.package }}.data import shapes
from {{ cookiecutter.package }}.engine import schema
from {{ cookiecutter.package }}.engine.loader import LoaderSettings, TrainLoader, resolve_settings, usable_cpus

ROOT = Path(__file__).resolve().parents[1]
EPOCHS, ROUNDS = 2, 2  # the two settings take turns; the best round of each counts


def main() -> None:
    schema.register()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        throughput = resolve_settings(compose("config", overrides=["loader=throughput"]).loader, "cpu")
    dataset = shapes("data/shapes-600-32", "train", transform=train_transform(32))
    cores = usable_cpus()
    threads, single, many = torch.get_num_threads(), 0.0, 0.0
    for _ in range(ROUNDS):
        torch.set_num_threads(1)
        alone = TrainLoader(dataset, LoaderSettings(throughput.batch_size, 0, None, False, False, 0.0), seed=0)
        single = max(single, samples_per_s(alone, EPOCHS))
        torch.set_num_threads(threads)
        many = max(many, samples_per_s(TrainLoader(dataset, throughput, seed=0), EPOCHS))
    ratio = many / (cores * single)
    print(
        f"P4 loader scaling, {len(dataset)} shapes images, batch {throughput.batch_size}, {EPOCHS} epochs after a "
        f"warm-up, best of {ROUNDS} rounds"
    )
    print(f"{'setting':<44} {'samples/s':>10}")
    print(f"{'one process (num_workers=0, 1 thread)':<44} {single:>10.0f}")
    print(f"{f'{cores} x that (usable CPUs)':<44} {cores * single:>10.0f}")
    profile = f"loader=throughput ({throughput.num_workers} workers, prefetch {throughput.prefetch_factor})"
    print(f"{profile:<44} {many:>10.0f}")
    print(
        f"ratio throughput / (cores x single) = {ratio:.3f}: how much of the usable CPUs' loading capacity the "
        "workers deliver to the loop (1.0: perfect scaling)"
    )


if __name__ == "__main__":
    main()
