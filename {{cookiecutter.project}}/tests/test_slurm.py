"""SLURM through Hydra's submitit launcher, run for real with submitit's local executor.

`hydra/launcher=submitit_local` pickles the job and runs it as the SLURM executor does (submitit's
job process, its signal handlers, its requeue on the preemption signal), without a cluster.
Needs the slurm extra: pip install -e ".[slurm]".
"""

import re
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from {{ cookiecutter.package }} import config
from tests.helpers import PROJECT, read_jsonl, same_weights, wait_for_steps

NEEDS = 'the slurm extra is not installed: pip install -e ".[slurm]"'
pytest.importorskip("submitit", reason=NEEDS)
pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason=NEEDS)
psutil = pytest.importorskip("psutil")

from submitit.local.local import LocalJobEnvironment  # noqa: E402

# What the launcher does with train.py's main(): cloudpickle it by value (train.py runs as __main__,
# which the job cannot import), then the job loads it and, on preemption, pickles it again to requeue.
PICKLE_MAIN = """
import copyreg, runpy, sys, types
import cloudpickle
main = runpy.run_path("train.py", run_name="train_script")["main"]  # like __main__: not importable by name
with open(sys.argv[1], "wb") as f:
    cloudpickle.dump(main, f)
for kind in [k for k in copyreg.dispatch_table if issubclass(k, types.ModuleType)]:
    del copyreg.dispatch_table[kind]  # undo submit.picklable_modules(): the submission as it failed before
try:
    cloudpickle.dumps(main)
except TypeError as e:
    print("without:", e)
"""
LOAD_AND_REPICKLE = """
import pickle, sys
import cloudpickle
with open(sys.argv[1], "rb") as f:
    main = pickle.load(f)
cloudpickle.dumps(main)  # what submitit's checkpoint does before it requeues the job
print("job:", main.__name__, type(main.__wrapped__.__globals__["torch"].backends.cudnn).__name__)
"""


def python(code, *args):
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=PROJECT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_main_pickles_by_value_loads_in_a_fresh_process_and_pickles_again(tmp_path):
    blob = tmp_path / "main.pkl"
    out = python(PICKLE_MAIN, str(blob))
    assert "without: cannot pickle 'CudnnModule' object" in out  # the failure the launcher hit, reproduced
    assert python(LOAD_AND_REPICKLE, str(blob)).strip() == "job: main CudnnModule"


def test_slurm_launcher_composes_and_pickles_the_same_job():
    """The slurm config composes, builds submitit's SLURM launcher, and that launcher pickles as the local one does."""
    from hydra.utils import instantiate

    config.register()
    with initialize_config_dir(str(PROJECT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=slurm", "resume=latest"], return_hydra_config=True)
    launcher = instantiate(cfg.hydra.launcher)
    assert type(launcher).__name__ == "SlurmLauncher" and launcher._EXECUTOR == "slurm"
    assert launcher.params["signal_delay_s"] == 120 and launcher.params["max_num_timeout"] == 5
    assert hasattr(launcher, "checkpoint")  # what submitit calls on the preemption signal before it requeues


def preempt(job_dir):
    """Signal a running submitit_local job the way SLURM does on preemption or before the time limit:
    submitit's preemption signal (USR2 unless SUBMITIT_PREEMPT_SIGNAL says otherwise) to the job's
    task and every process under it. The job id Hydra records is the local controller's pid."""
    job_id = OmegaConf.load(job_dir / ".hydra/hydra.yaml").hydra.job.id
    tasks = psutil.Process(int(job_id)).children()
    assert tasks, f"job {job_id} has no running task"
    for proc in [p for task in tasks for p in (task, *task.children(recursive=True))]:
        proc.send_signal(LocalJobEnvironment._usr_sig())


@pytest.mark.slow
def test_multirun_launches_jobs_and_a_preempted_job_is_requeued_and_resumes_exactly(tmp_path, shapes):
    sweep = tmp_path / "multirun"
    # three jobs: 0 and 1 train the same run (job 0 is preempted, job 1 runs through), 2 another seed
    cmd = [sys.executable, "train.py", "-m", "hydra/launcher=submitit_local", f"hydra.sweep.dir={sweep}",
           *shapes, "loader.batch_size=16", "seed=0,0,1", "resume=latest",
           "checkpoint.search_dir=${hydra:runtime.output_dir}"]  # each job resumes from its own folder only
    proc = subprocess.Popen(cmd, cwd=PROJECT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_steps(sweep / "0", 2, timeout=300)
        preempt(sweep / "0")
        out, _ = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-3000:]

    for job in ("0", "1", "2"):  # each job in its own folder, complete
        assert [r["epoch"] for r in read_jsonl(sweep / job / "metrics.jsonl")] == [0, 1], job
        assert (sweep / job / "checkpoints/last.pth").is_file(), job
    job_id = OmegaConf.load(sweep / "0/.hydra/hydra.yaml").hydra.job.id
    submitit_log = (sweep / ".submitit" / job_id / f"{job_id}_0_log.out").read_text()
    assert "this job is preempted" in submitit_log and "Requeued job" in submitit_log, submitit_log
    assert submitit_log.count("Starting with JobEnvironment") == 2, submitit_log  # the same job ran twice
    resumed = re.findall(r"resumed from step (\d+)", (sweep / "0/train.log").read_text())
    total = read_jsonl(sweep / "1/metrics.jsonl")[-1]["step"]
    assert len(resumed) == 1 and 0 < int(resumed[0]) < total  # the requeued job continued, it did not start over

    assert same_weights(sweep / "1/checkpoints/last.pth", sweep / "0/checkpoints/last.pth")
    steps0, steps1 = read_jsonl(sweep / "0/steps.jsonl"), read_jsonl(sweep / "1/steps.jsonl")
    assert [r["step"] for r in steps0] == list(range(1, total + 1))  # one folder, one unbroken record
    assert [r["loss"] for r in steps0] == [r["loss"] for r in steps1]
    assert not same_weights(sweep / "1/checkpoints/last.pth", sweep / "2/checkpoints/last.pth")  # the check can fail
