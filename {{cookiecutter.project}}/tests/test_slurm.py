"""SLURM through Hydra's submitit launcher, run for real without a cluster.

`hydra/launcher=submitit_local` pickles the jobs and runs them as the SLURM executor does (submitit's
job process, its signal handlers, its requeue on the preemption signal). `hydra/launcher=slurm`
itself runs with stand-ins for sbatch, srun and scontrol only. Needs the slurm extra:
pip install -e ".[slurm]".
"""

import os
import pickle
import re
import shlex
import signal
import subprocess
import sys
import time

import psutil
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from {{ cookiecutter.package }}.engine import schema
from tests import helpers
from tests.helpers import PROJECT, RNG_DATA, load_ckpt, read_jsonl, run_train, same_weights, wait_for_steps

NEEDS = 'the slurm extra is not installed: pip install -e ".[slurm]"'
pytest.importorskip("submitit", reason=NEEDS)
pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason=NEEDS)

from submitit.local.local import LocalJobEnvironment  # noqa: E402

# What the launcher does with train.py's main(): cloudpickle it by value (train.py runs as __main__,
# which the job cannot import), then the job loads it and, on preemption, pickles it again to requeue.
# cloudpickle pickles modules by reference, but recognises one only by its exact type: some of torch's are instances
# of a module subclass (`torch.backends.cudnn` is a CudnnModule), and code in train.py naming one could not be
# submitted (cloudpipe/cloudpickle#405, pytorch/pytorch#48832, facebookresearch/hydra#1180): so train.py names none,
# and the device and determinism settings live in the package (functions there are pickled by reference).
PICKLE_MAIN = """
import runpy, sys
import cloudpickle
blob, script, sys.argv = sys.argv[1], sys.argv[2], ["train.py", "--cfg", "job"]  # --cfg: main()'s body does not run
main = runpy.run_path(script, run_name="__main__")["main"]
try:
    with open(blob, "wb") as f:
        cloudpickle.dump(main, f)
    print("pickled")
except TypeError as e:
    print("refused:", e)
"""
LOAD_AND_REPICKLE = """
import pickle, sys
import cloudpickle
with open(sys.argv[1], "rb") as f:
    main = pickle.load(f)
cloudpickle.dumps(main)  # what submitit's checkpoint does before it requeues the job
print("job:", main.__name__)
"""


def python(code, *args):
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=PROJECT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow  # three processes of torch, about 20 s; the slow tier's submitit jobs pickle main() for real too
def test_main_pickles_by_value_loads_in_a_fresh_process_and_pickles_again(tmp_path):
    blob = tmp_path / "main.pkl"
    assert python(PICKLE_MAIN, str(blob), "train.py").strip().splitlines()[-1] == "pickled"  # after --cfg's config
    assert python(LOAD_AND_REPICKLE, str(blob)).strip() == "job: main"
    # the negative control: the same train.py with one line naming torch.backends.cudnn in its loop cannot be sent
    source = (PROJECT / "train.py").read_text()
    assert "    stop = StopRequest()" in source
    touched = tmp_path / "train.py"
    (tmp_path / "conf").symlink_to(PROJECT / "conf")
    line = "    torch.backends.cudnn.benchmark = False\n"
    touched.write_text(source.replace("    stop = StopRequest()", line + "    stop = StopRequest()", 1))
    out = python(PICKLE_MAIN, str(tmp_path / "touched.pkl"), str(touched))
    assert re.search(r"refused: cannot pickle '(CudnnModule|ConfigModuleInstance)' object", out), out


def test_slurm_launcher_config_composes_into_submitits_slurm_launcher():
    from hydra.utils import instantiate

    schema.register()
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
    cmd = [
        sys.executable,
        "train.py",
        "-m",
        "hydra/launcher=submitit_local",
        f"hydra.sweep.dir={sweep}",
        "hydra.sweep.subdir=${hydra.job.num}",  # job folders 0, 1, 2
        *shapes,
        "loader.batch_size=16",
        "seed=0,0,1",
        "resume=latest",
        "checkpoint.search_dir=${hydra:runtime.output_dir}",
    ]  # each job resumes from its own folder only
    proc = subprocess.Popen(cmd, cwd=PROJECT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_steps(sweep / "0", 1, timeout=300)  # training: whichever step the signal lands on
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
    steps = [r["step"] for r in read_jsonl(sweep / "0/steps.jsonl")]
    assert steps == sorted(set(steps)) and steps[-1] == total  # one folder, one record: nothing logged twice
    assert not same_weights(sweep / "1/checkpoints/last.pth", sweep / "2/checkpoints/last.pth")  # the check can fail


# torchrun sets OMP_NUM_THREADS=1 only with --nproc_per_node > 1, submitit never: CPU kernels with other thread
# counts differ in the last bits, so every run compared below gets the same one.
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}
STRAIGHT: dict[tuple, object] = {}  # (processes, overrides) -> the run folder: the tests below share them


def straight_run(tmp_path_factory, processes: int, overrides: list[str]):
    """The run never stopped, as one plain process or under `torchrun --nproc_per_node=2`; its folder."""
    key = (processes, *overrides)
    if key not in STRAIGHT:
        run_dir = tmp_path_factory.mktemp("straight")
        if processes == 1:
            run_train(run_dir, *overrides, env=ONE_THREAD)
        else:
            command = helpers.torchrun_cmd(run_dir, *overrides)
            ran = subprocess.run(command, cwd=PROJECT, env=ONE_THREAD, capture_output=True, text=True, timeout=300)
            assert ran.returncode == 0, ran.stderr[-3000:]
        STRAIGHT[key] = run_dir
    return STRAIGHT[key]


@pytest.mark.slow
def test_a_two_task_job_is_one_two_rank_run_and_a_preempted_one_resumes_exactly(tmp_path, tmp_path_factory, shapes):
    overrides = [*shapes, "loader.batch_size=16", "log_every_steps=1"]
    cmd = [
        sys.executable,
        "train.py",
        "-m",
        "hydra/launcher=submitit_local",
        "hydra.launcher.tasks_per_node=2",
        f"hydra.sweep.dir={tmp_path}/multirun-" + "${now:%S%f}",  # to the microsecond: resolved once, in the launcher
        "hydra.sweep.subdir=${hydra.job.num}",
        *overrides,
        "resume=latest",
        "checkpoint.search_dir=${hydra:runtime.output_dir}",
    ]
    proc = subprocess.Popen(
        cmd, cwd=PROJECT, env=ONE_THREAD, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.time() + 300
        while not list(tmp_path.glob("multirun-*/0")) and time.time() < deadline:
            time.sleep(0.2)
        (sweep,) = tmp_path.glob("multirun-*")  # the tasks and the requeued job share the one folder
        wait_for_steps(sweep / "0", 1, timeout=300)
        preempt(sweep / "0")  # both tasks, as SLURM signals every task of the job
        out, _ = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert list(tmp_path.glob("multirun-*")) == [sweep]
    job_id = OmegaConf.load(sweep / "0/.hydra/hydra.yaml").hydra.job.id
    logs = [(sweep / ".submitit" / job_id / f"{job_id}_{task}_log.out").read_text() for task in (0, 1)]
    assert "Requeued job" in logs[0] and all(log.count("Starting with JobEnvironment") == 2 for log in logs), logs

    job, reference = sweep / "0", straight_run(tmp_path_factory, 2, overrides)
    alone = straight_run(tmp_path_factory, 1, overrides)  # what each task trained before: a run of its own
    per_epoch = [r["step"] for r in read_jsonl(job / "metrics.jsonl")]
    assert per_epoch == [r["step"] for r in read_jsonl(reference / "metrics.jsonl")]
    assert -(-read_jsonl(alone / "metrics.jsonl")[0]["step"] // 2) == per_epoch[0]  # half the steps of one process
    assert len(load_ckpt(job / "checkpoints/last.pth")["ranks"]) == 2  # one checkpoint holds both ranks
    steps = [r["step"] for r in read_jsonl(job / "steps.jsonl")]
    assert steps == list(range(1, per_epoch[-1] + 1))  # one line per step: only rank 0 writes, nothing twice
    resumed = re.findall(r"resumed from step (\d+)", (job / "train.log").read_text())
    assert len(resumed) == 1 and 0 < int(resumed[0]) < per_epoch[-1], resumed  # the requeue went on from the stop
    assert same_weights(reference / "checkpoints/last.pth", job / "checkpoints/last.pth")
    assert not same_weights(alone / "checkpoints/last.pth", job / "checkpoints/last.pth")  # the check can fail


# Stand-ins for the three SLURM commands submitit calls; everything else is the real launcher and job.
FAKE_SLURM = {
    "sbatch": 'echo "Submitted batch job 4242"',  # submitit keeps the script it hands over as <id>_submission.sh
    "srun": "exit 1",  # only looked for: the job below is started with srun's command line, as srun would
    "scontrol": 'echo "$@" >> "$(dirname "$0")/scontrol.calls"',  # submitit requeues with `scontrol requeue <id>`
}
SLURM_TASK_ENV = {
    "SLURM_JOB_ID": "4242",
    "SLURM_NTASKS": "1",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_JOB_NUM_NODES": "1",
    "SLURM_JOB_NODELIST": "localhost",
    "SUBMITIT_EXECUTOR": "slurm",
}


def slurm_commands(bin_dir):
    bin_dir.mkdir()
    for name, body in FAKE_SLURM.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def slurm_task_env(tasks: int, rank: int) -> dict:
    """What srun sets for task `rank` of a job of `tasks` tasks on one node."""
    counts = {"SLURM_NTASKS": str(tasks), "SLURM_NTASKS_PER_NODE": str(tasks)}
    return {**SLURM_TASK_ENV, **counts, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)}


def run_slurm_task(command, env, log, stop_after_steps=None, job_dir=None, tasks=1) -> list[int]:
    """The job's tasks as srun starts them on a node; with stop_after_steps, preempted (USR2 to every task) once they
    trained that far. Returns the tasks' exit codes."""
    with open(log, "a") as out:
        procs = [
            subprocess.Popen(
                command, cwd=PROJECT, env={**env, **slurm_task_env(tasks, rank)}, stdout=out, stderr=subprocess.STDOUT
            )
            for rank in range(tasks)
        ]
        try:
            if stop_after_steps:
                wait_for_steps(job_dir, stop_after_steps, timeout=300)
                for task in procs:
                    for p in (psutil.Process(task.pid), *psutil.Process(task.pid).children(recursive=True)):
                        p.send_signal(signal.SIGUSR2)
            return [proc.wait(timeout=600) for proc in procs]
        finally:
            for proc in procs:
                proc.kill()


@pytest.mark.slow
@pytest.mark.parametrize("tasks", [1, 2])
def test_slurm_launcher_submits_and_its_job_requeues_through_scontrol_and_resumes_exactly(
    tmp_path, tmp_path_factory, shapes, tasks
):
    """With 2 tasks the job is one 2-rank run: its ranks from SLURM's variables through submitit, rank 0's host
    from the node list, the port from the job id (the same after the requeue)."""
    sweep, env = tmp_path / "multirun", {**slurm_commands(tmp_path / "bin"), "OMP_NUM_THREADS": "1"}
    overrides = [*shapes, "loader.batch_size=16", "log_every_steps=1"]  # a stop at the next step: mid-epoch
    submit = subprocess.Popen(
        [
            sys.executable,
            "train.py",
            "-m",
            "hydra/launcher=slurm",
            f"hydra.launcher.tasks_per_node={tasks}",
            f"hydra.sweep.dir={sweep}",
            "hydra.sweep.subdir=${hydra.job.num}",
            *overrides,
            "resume=latest",
            "checkpoint.search_dir=${hydra:runtime.output_dir}",
        ],
        cwd=PROJECT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    folder = sweep / ".submitit/4242"
    try:
        deadline = time.time() + 300
        while not (folder / "4242_submitted.pkl").exists() and submit.poll() is None and time.time() < deadline:
            time.sleep(0.1)
    finally:
        submit.kill()  # from here on it would poll sacct for the job's state: the cluster's part
    assert (folder / "4242_submitted.pkl").exists(), submit.communicate()[0][-3000:]
    script = (folder / "4242_submission.sh").read_text()
    assert "#SBATCH --signal=USR2@120" in script and "#SBATCH --time=240" in script, script
    assert f"#SBATCH --ntasks-per-node={tasks}" in script, script
    srun = shlex.split(script.strip().splitlines()[-1].replace("%j", "4242"))
    assert srun[0] == "srun"
    command = srun[srun.index("--error") + 2 :]  # what srun runs: python -u -m submitit.core._submit <folder>
    assert command[-3:] == ["-m", "submitit.core._submit", str(folder)]

    log = tmp_path / "task.log"
    codes = run_slurm_task(command, env, log, stop_after_steps=1, job_dir=sweep / "0", tasks=tasks)
    assert codes[0] == 255, log.read_text()[-3000:]  # rank 0 requeues the job and exits; the others just end
    assert (tmp_path / "bin/scontrol.calls").read_text() == "requeue 4242\n"  # submitit asked SLURM to requeue it
    codes = run_slurm_task(command, env, log, tasks=tasks)  # the requeued job: the same command again
    assert codes == [0] * tasks, log.read_text()[-3000:]
    assert all(pickle.loads((folder / f"4242_{k}_result.pkl").read_bytes())[0] == "success" for k in range(tasks))

    resumed = re.findall(r"resumed from step (\d+)", (sweep / "0/train.log").read_text())
    assert len(resumed) == 1 and 0 < int(resumed[0]) < read_jsonl(sweep / "0/metrics.jsonl")[-1]["step"]
    straight = straight_run(tmp_path_factory, tasks, overrides)
    assert len(load_ckpt(sweep / "0/checkpoints/last.pth")["ranks"]) == tasks
    assert same_weights(straight / "checkpoints/last.pth", sweep / "0/checkpoints/last.pth")


@pytest.mark.parametrize(
    "env, says",
    [
        ({"SLURM_JOB_NODELIST": "node-that-does-not-exist.invalid"}, "meet at rank 0's host node-that-does-not"),
        ({"WORLD_SIZE": "1", "RANK": "0"}, "with 2 tasks but WORLD_SIZE=1: the tasks would train in separate"),
    ],
    ids=["host-does-not-resolve", "smaller-world-size"],
)
@pytest.mark.slow  # a start of torch each; the fast tier refuses SLURM tasks that cannot meet in the test below
def test_a_job_of_two_tasks_that_cannot_meet_is_refused_in_one_line(tmp_path, shapes, env, says):
    """Task 0 of a 2-task SLURM job (submitit's variables, as srun sets them): no folder, no training alone."""
    proc = run_train(tmp_path / "run", *shapes, expect=2, env={**slurm_task_env(2, 0), **env}, timeout=120)
    assert proc.stderr.startswith("error: ") and says in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert not (tmp_path / "run").exists()  # refused before Hydra made the run folder


def test_several_slurm_tasks_without_submitit_or_torchrun_are_refused_in_one_line(tmp_path):
    """`srun -n 2 python train.py`: SLURM says 2 tasks, and nothing says where they meet; each would train alone."""
    env = {"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_JOB_ID": "7"}
    proc = run_train(tmp_path / "run", *RNG_DATA, expect=2, env=env, timeout=120)
    assert proc.stderr.startswith("error: this process is one of 2 SLURM tasks") and proc.stderr.count("\n") == 1
    assert not (tmp_path / "run").exists()  # refused before Hydra made the run folder


def test_slurm_launcher_config_composes():
    schema.register()
    with initialize_config_dir(str(PROJECT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=slurm", "resume=latest"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert launcher.signal_delay_s == 120 and launcher.max_num_timeout == 5 and launcher.tasks_per_node == 1
