"""loader=auto (engine/loader_tuning.py): trials pick the loader settings under the budgets, the pick is written and
kept by the checkpoint, and it changes nothing but speed."""

import json
import time

import pytest
import torch
from torch.utils.data import Dataset, default_collate

from {{ cookiecutter.package }}.engine import monitor
from {{ cookiecutter.package }}.engine.failures import EXIT_BAD_SAMPLE
from {{ cookiecutter.package }}.engine.loader import LoaderSettings, usable_cpus
from {{ cookiecutter.package }}.engine.loader_tuning import TUNED, Budget, tune
from tests.helpers import RNG_DATA, load_ckpt, read_jsonl, run_torchrun, run_train, same_weights

MiB = 2**20


class BigSamples(Dataset):
    """Samples of 8 MiB each that wait 5 ms on a read: a batch of 4 is 32 MiB and a worker holds two of them in
    flight, so the batches weigh on a RAM budget, and more workers help."""

    def __len__(self) -> int:
        return 96

    def __getitem__(self, index: int):
        time.sleep(0.005)
        return torch.full((2 * MiB,), float(index)), index % 2


class NoModel:
    """A step that costs nothing: the trials' figures are the loader's."""

    def __call__(self, batch) -> None:
        pass

    def sync(self) -> None:
        pass


def tuned(budget_mib: float):
    base = LoaderSettings(4, 2, 2, False, True, 0.0)
    budget = Budget(budget_mib, 8, 20.0)
    return tune(BigSamples(), default_collate, NoModel(), base, list(TUNED), budget, seed=0)


def test_a_setting_past_the_ram_budget_by_its_plan_is_never_tried():
    roomy = tuned(monitor.pss_mib(frozenset()) + 4000)  # the control: with room to spare, four workers are tried
    assert (4, 2) in {(t.num_workers, t.prefetch_factor) for t in roomy.trials}, (roomy.skipped, roomy.trials)
    main = roomy.trials[0].peak_pss_mib  # num_workers=0: this process with a batch in hand (steady within ~20 MiB)
    pick = tuned(main + 160)  # two workers' batches in flight (128 MiB) fit the plan, four workers' (256 MiB) do not
    tried = {(t.num_workers, t.prefetch_factor) for t in pick.trials}
    assert tried and all(w < 4 for w, _ in tried), tried
    assert pick.skipped and all("over the RAM budget" in s["why"] for s in pick.skipped), pick.skipped
    skipped = {(s["num_workers"], s["prefetch_factor"]) for s in pick.skipped}
    assert (4, 2) in skipped and not skipped & tried, (skipped, tried)
    assert pick.needs["ram_mib"] <= main + 160


def test_auto_writes_its_trials_and_pick_and_changes_no_weight(tmp_path):
    """rng_mode=per_sample: auto's weights are torch.equal to a fixed profile's; the log has one line a trial and
    one for the pick, loader_pick.json the trials, the checkpoint the pick. The control: another seed differs."""
    auto = run_train(tmp_path / "auto", *RNG_DATA, "epochs=2", "loader=auto")
    fixed = run_train(tmp_path / "fixed", *RNG_DATA, "epochs=2", "loader=memory-tight")
    other = run_train(tmp_path / "other", *RNG_DATA, "epochs=2", "loader=memory-tight", "seed=1")
    assert auto and fixed and other
    last = "checkpoints/last.pth"
    assert same_weights(tmp_path / "auto" / last, tmp_path / "fixed" / last)
    assert not same_weights(tmp_path / "other" / last, tmp_path / "fixed" / last)
    log = (tmp_path / "auto" / "train.log").read_text()
    picked = json.loads((tmp_path / "auto" / "loader_pick.json").read_text())
    assert log.count("loader=auto trial ") == len(picked["trials"]) >= 1
    assert log.count("loader=auto picks num_workers=") == 1
    assert set(picked["settings"]) >= {"num_workers", "prefetch_factor", "persistent_workers", "pin_memory"}
    assert load_ckpt(tmp_path / "auto" / last)["ranks"][0]["loader"]["pick"]["settings"] == picked["settings"]
    assert [r["val_loss"] for r in read_jsonl(tmp_path / "auto" / "metrics.jsonl")] == [
        r["val_loss"] for r in read_jsonl(tmp_path / "fixed" / "metrics.jsonl")
    ]


@pytest.mark.slow
def test_a_resume_reuses_the_pick_without_trials_and_stays_exact(tmp_path):
    whole = tmp_path / "whole"
    run_train(whole, *RNG_DATA, "epochs=2", "loader=auto")
    part = tmp_path / "part"
    run_train(part, *RNG_DATA, "epochs=2", "loader=auto", "max_steps=7")
    resumed = run_train(part, *RNG_DATA, "epochs=2", "loader=auto", f"resume={part}/checkpoints/last.pth")
    said = resumed.stdout + resumed.stderr
    assert "the checkpoint's pick, no trials" in said and "loader=auto trial" not in said
    assert same_weights(whole / "checkpoints/last.pth", part / "checkpoints/last.pth")


@pytest.mark.slow
def test_a_resume_with_another_pick_is_still_exact_under_per_sample(tmp_path):
    """A budget the saved pick does not fit: the resume says so and tunes again; per_sample keeps the weights. The
    control: the same under per_worker keeps the pick (its streams depend on the workers)."""
    whole = tmp_path / "whole"
    run_train(whole, *RNG_DATA, "epochs=2", "loader=auto")
    part = tmp_path / "part"
    run_train(part, *RNG_DATA, "epochs=2", "loader=auto", "max_steps=7")
    ckpt = f"resume={part}/checkpoints/last.pth"
    proc = run_train(part, *RNG_DATA, "epochs=2", "loader=auto", "loader.cpu_budget=1", "loader.ram_budget_mib=1", ckpt,
                     expect=2)  # fmt: skip
    assert "does not fit this machine" in proc.stdout + proc.stderr  # a 1 MiB budget fits nothing: one error line
    roomy = run_train(part, *RNG_DATA, "epochs=2", "loader=auto", "loader.num_workers=0", ckpt)
    assert "num_workers=0 kept as set" in roomy.stdout + roomy.stderr + (part / "train.log").read_text()
    assert same_weights(whole / "checkpoints/last.pth", part / "checkpoints/last.pth")


@pytest.mark.slow
def test_per_worker_keeps_its_first_pick(tmp_path):
    """A resume on a budget the pick does not fit keeps it under per_worker, and continues exactly: the weights of
    a fixed profile with the picked workers run without a stop."""
    part, whole = tmp_path / "part", tmp_path / "whole"
    run_train(part, *RNG_DATA, "epochs=2", "loader=auto", "rng_mode=per_worker", "max_steps=7")
    first = json.loads((part / "loader_pick.json").read_text())["settings"]
    resumed = run_train(part, *RNG_DATA, "epochs=2", "loader=auto", "rng_mode=per_worker", "loader.ram_budget_mib=1",
                        f"resume={part}/checkpoints/last.pth")  # fmt: skip
    said = resumed.stdout + resumed.stderr
    assert "the checkpoint's pick, no trials" in said and "kept, as the batches depend on it" in said
    assert json.loads((part / "loader_pick.json").read_text())["settings"] == first
    workers, persistent = first["num_workers"], str(first["persistent_workers"]).lower()
    run_train(whole, *RNG_DATA, "epochs=2", "loader=balanced", "rng_mode=per_worker", f"loader.num_workers={workers}",
              f"loader.persistent_workers={persistent}")  # fmt: skip
    assert same_weights(whole / "checkpoints/last.pth", part / "checkpoints/last.pth")


@pytest.mark.slow  # three runs, two of them into the trials
def test_a_sample_that_fails_in_the_trials_fails_as_in_a_run_and_skip_still_skips(tmp_path):
    """A failing sample that the trials read first is named by the data set's own index, with its traceback, as a
    fixed profile's run names it (the control); with data.on_bad_sample=skip the trials leave it out, the run trains.
    The last sample is in every trial, whose probe of evenly spaced samples is read whole in its first trial."""
    bad = [*RNG_DATA, "data.train.size=2000", "data.train._target_=tests.datasets.FailsAtIndex", "+data.train.bad=1999"]
    auto = run_train(tmp_path / "auto", *bad, "epochs=1", "loader=auto", expect=EXIT_BAD_SAMPLE)
    fixed = run_train(tmp_path / "fixed", *bad, "epochs=1", "loader=balanced", expect=EXIT_BAD_SAMPLE)
    for proc in (auto, fixed):
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("error: data set index 1999: ValueError: sample 1999 has no label"), proc.stderr
        assert "in checked" in proc.stderr, proc.stderr[-2000:]
    assert "loader=auto picks" not in auto.stdout + auto.stderr  # it failed in the trials
    run_train(tmp_path / "skip", *bad, "epochs=1", "loader=auto", "data.on_bad_sample=skip")
    assert "loader=auto picks" in (tmp_path / "skip" / "train.log").read_text()


@pytest.mark.parametrize(
    "override, said",
    [
        ("loader.cpu_budget=0", "loader.cpu_budget must be an integer >= 1"),
        ("loader.cpu_budget=4096", "loader.cpu_budget=4096 is more than the"),
        ("loader.tune_s=0", "loader.tune_s must be a number > 0"),
        ("loader.ram_budget_mib=0.01", "over loader.ram_budget_mib=0.01"),
    ],
)
def test_bad_budgets_are_refused_in_one_line(tmp_path, override, said):
    proc = run_train(tmp_path, *RNG_DATA, "epochs=1", "loader=auto", override, expect=2)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and said in errors[0], proc.stderr[-2000:]
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "loader_pick.json").exists()
{% if cookiecutter.with_streams == "yes" %}


@pytest.mark.slow
def test_a_shard_stream_under_auto_reads_each_record_once_and_resumes_exactly(tmp_path):
    """Auto's trials read the stream through its own loaders: the run still reads each record once per epoch, and a
    mid-epoch stop resumes to the weights of a run that never stopped, with the same settings (a shard stream's
    batches depend on its workers, so the straight run is the fixed profile with the first run's pick)."""
    from tests.helpers import recorded_steps
    from tests.test_stream_train import ALL, STREAM, epochs_of, per_epoch

    overrides = [o for o in STREAM if not o.startswith("loader.num_workers")]
    once, record = tmp_path / "once", tmp_path / "samples"
    run_train(once, *overrides, "loader=auto", env={"RECORD_SAMPLES": str(record)})
    picked = json.loads((once / "loader_pick.json").read_text())["settings"]["num_workers"]
    assert epochs_of(recorded_steps(record), per_epoch(workers=max(picked, 1))) == [ALL, ALL]
    first, straight = tmp_path / "first", tmp_path / "straight"
    run_train(first, *overrides, "loader=auto", "max_steps=11")
    run_train(first, *overrides, "loader=auto", f"resume={first}/checkpoints/last.pth")
    pick = json.loads((first / "loader_pick.json").read_text())["settings"]
    fixed = [f"loader.{key}={str(pick[key]).lower()}" for key in ("num_workers", "persistent_workers")]
    run_train(straight, *overrides, "loader=balanced", *fixed)
    assert same_weights(straight / "checkpoints/last.pth", first / "checkpoints/last.pth")
{% endif %}


@pytest.mark.slow
def test_each_rank_tunes_and_logs_its_pick_under_torchrun(tmp_path):
    """Two ranks share the node's CPUs (cpu_budget: 1 each on 2 CPUs), each writes its pick; per_sample keeps the
    weights of a fixed profile on the same two processes."""
    from tests.test_world_size import command

    auto, fixed = tmp_path / "auto", tmp_path / "fixed"
    env = {"OMP_NUM_THREADS": "1"}
    proc = run_torchrun(auto, *[o for o in command() if o != "loader.num_workers=1"], "loader=auto", env=env,
                        timeout=600)  # fmt: skip
    said = proc.stdout + proc.stderr
    assert "rank 0: loader=auto picks" in said and "rank 1: loader=auto picks" in said
    run_torchrun(fixed, *command(), env=env, timeout=600)
    for name in ("loader_pick.json", "loader_pick.rank1.json"):
        picked = json.loads((auto / name).read_text())
        assert picked["trials"] and picked["budget"]["cpus"] == max(usable_cpus() // 2, 1)
    assert same_weights(auto / "checkpoints/last.pth", fixed / "checkpoints/last.pth")
