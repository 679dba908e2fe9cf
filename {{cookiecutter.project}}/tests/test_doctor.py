"""The loader doctor: one run measures every profile, writes doctor.json and recommends; its rules on given figures."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from {{ cookiecutter.package }}.doctor import model_memory, recommend
from tests.helpers import PROJECT
{% if cookiecutter.with_streams == "yes" %}
from tests.test_stream_train import STREAM
{% endif %}

PROFILES = sorted(p.stem for p in (PROJECT / "conf" / "loader").glob("*.yaml") if p.stem != "auto")  # fixed ones


@pytest.mark.slow
def test_doctor_measures_every_profile(tmp_path, shapes_root):
    cmd = [
        sys.executable,
        "-m",
        "{{ cookiecutter.package }}.doctor",
        f"data.root={shapes_root}",
        "data.per_class=40",
        "loader.batch_size=16",
        f"hydra.run.dir={tmp_path}",
    ]
    proc = subprocess.run(cmd, cwd=PROJECT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "doctor.json").read_text())
    assert [r["profile"] for r in report["profiles"]] == PROFILES
    for r in report["profiles"]:
        assert r["batches_per_epoch"] == 10 and r["batches_per_s"] > 0 and r["peak_pss_mib"] > 0
        assert "prefetch plan" in r["plan"] and r["plan_mib"] > 0
        assert r["first_batch_e1_s"] > 0 and r["first_batch_e2_s"] > 0 and r["worker_start_s"] is not None
    assert report["recommendation"]["profile"] in PROFILES and report["recommendation"]["reasons"]
    assert "recommendation: loader=" in proc.stdout and "batches/s" in proc.stdout
    assert report["machine"]["shm_size_mib"] > 0 and "/dev/shm: " in proc.stdout  # where the batches in flight live
    # loader=auto's trials and pick, by train.py's code (engine/loader_tuning.py): what loader_pick.json holds
    auto = report["auto"]
    assert auto["trials"] and proc.stdout.count("loader=auto trial ") == len(auto["trials"])
    assert f"loader=auto would pick num_workers={auto['settings']['num_workers']} " in proc.stdout
    assert all("MiB free of" in r["plan"] for r in report["profiles"] if r["num_workers"])
    assert "model memory per rank: parameters" in proc.stdout and report["model_memory_mib"]["ddp_per_rank"] > 0
{% if cookiecutter.with_streams == "yes" %}


@pytest.mark.slow
def test_doctor_measures_a_stream(tmp_path):
    """A shard stream (tests.datasets.CountingShards) through every profile, read as train.py reads it."""
    data = [o for o in STREAM if o.startswith(("data.", "~data.", "+data.", "model.", "~model.", "+model.", "task."))]
    doctor = [sys.executable, "-m", "{{ cookiecutter.package }}.doctor"]
    cmd = [*doctor, *data, "loader.batch_size=8", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=PROJECT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "doctor.json").read_text())
    assert [r["profile"] for r in report["profiles"]] == PROFILES
    assert report["data"]["train_samples"] == 210  # the shards' sizes added
    for r in report["profiles"]:
        assert r["batches_per_s"] > 0 and r["first_batch_e2_s"] > 0 and r["plan_mib"] > 0
    assert report["recommendation"]["profile"] in PROFILES
{% endif %}


def test_model_memory_per_rank_whole_under_ddp{% if cookiecutter.with_fsdp == "yes" %}_and_split_under_fsdp{% endif %}():
    layer = torch.nn.Linear(256, 256)
    params = (256 * 256 + 256) * 4 / 2**20
    found = model_memory(layer, torch.optim.AdamW(layer.parameters(), lr=0.1))
    assert found["parameters"] == found["gradients"] == pytest.approx(params)
    assert found["optimizer_state"] == pytest.approx(2 * params)  # Adam's two moments
{% if cookiecutter.with_fsdp == "yes" %}
    assert found["ddp_per_rank"] == pytest.approx(4 * params) and found["fsdp_per_rank"]["4"] == pytest.approx(params)
{% else %}
    assert found["ddp_per_rank"] == pytest.approx(4 * params)
{% endif %}
    assert model_memory(layer, torch.optim.SGD(layer.parameters(), lr=0.1))["optimizer_state"] == 0  # no momentum


def profile(name, workers, prefetch, persistent, rate, peak, restart=0.05):
    return {
        "profile": name,
        "num_workers": workers,
        "prefetch_factor": prefetch,
        "persistent_workers": persistent,
        "batches_per_s": rate,
        "peak_pss_mib": peak,
        "in_flight_mib": 10.0,
        "first_batch_e2_s": restart,
    }


PROFILE_SET = [
    profile("memory-tight", 1, 1, False, 10, 400),
    profile("balanced", 2, 2, True, 20, 800),
    profile("throughput", 8, 4, True, 60, 2000),
]


def test_recommend_follows_the_decision_table():  # docs/loader.md's table (Loader doctor)
    tight = recommend(PROFILE_SET, "balanced", model_bps=50, available_mib=1200, cores=8, full_batches=100)
    assert tight["profile"] == "memory-tight" and "memory is tight" in tight["reasons"][0]
    waiting = recommend(PROFILE_SET, "balanced", model_bps=50, available_mib=64000, cores=8, full_batches=100)
    assert waiting["profile"] == "throughput" and "waits on data" in waiting["reasons"][0]
    fine = recommend(PROFILE_SET, "balanced", model_bps=5, available_mib=64000, cores=8, full_batches=100)
    assert fine["profile"] == "balanced" and fine["overrides"] == []
    slow_start = [profile("memory-tight", 1, 1, False, 10, 400, restart=2.0)]
    start = recommend(slow_start, "memory-tight", model_bps=5, available_mib=64000, cores=8, full_batches=100)
    assert "loader.persistent_workers=true" in start["overrides"] and "slow epoch start" in start["reasons"][-1]


@pytest.mark.slow
def test_doctor_reads_the_conf_of_the_folder_it_runs_in(tmp_path):
    """As from a non-editable install: the package without conf/ beside it, run from a project root holding conf/."""
    site, project, elsewhere = tmp_path / "site", tmp_path / "project", tmp_path / "elsewhere"
    shutil.copytree(PROJECT / "{{ cookiecutter.package }}", site / "{{ cookiecutter.package }}", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(PROJECT / "conf", project / "conf")
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    cmd = [
        sys.executable,
        "-m",
        "{{ cookiecutter.package }}.doctor",
        "data=imagefolder",
        f"data.root={tmp_path}/none",
        "data.num_classes=3",
        f"hydra.run.dir={tmp_path}/run",
    ]
    composed = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True, timeout=120)
    # the config composed from ./conf and reached the data set, whose folder is missing
    lines = composed.stderr.strip().splitlines()
    assert composed.returncode == 2 and len(lines) == 1, composed.stderr
    assert lines[0].startswith(f"error: data folder '{tmp_path}/none/train' does not exist"), composed.stderr
    lost = subprocess.run(cmd, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120)
    assert lost.returncode == 2 and lost.stderr.strip().splitlines() == [
        f"error: no conf/config.yaml in '{elsewhere}': run the doctor from your project's root, the folder holding "
        "train.py and conf/"
    ], lost.stderr
