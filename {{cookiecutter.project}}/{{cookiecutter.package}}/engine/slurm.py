"""SLURM jobs: a submitit job of several tasks (Hydra's `hydra/launcher=slurm` or `submitit_local`) is one N-rank
run. Its ranks come from submitit's job environment and are exported as torchrun exports them, so the rest of the
engine (distributed.py) sees a torchrun process."""

from __future__ import annotations

import os
import socket

from .errors import UserError


def adopt_job_ranks() -> None:
    """Export torchrun's variables for this process when submitit started it as one of N > 1 tasks (none to add for
    one task, torchrun, a plain process): first thing in train(), as everything after reads them. N tasks that
    cannot meet are refused (UserError): without a rendezvous each task would train alone, all of them into the same
    run folder and checkpoint files. Not submitit's own `export()`: it also narrows CUDA_VISIBLE_DEVICES to the local
    rank's GPU, after which `cuda:<local rank>` exists on rank 0 only; here, as under torchrun, each rank takes
    `cuda:<local rank>` of the GPUs the job sees."""
    world = os.environ.get("WORLD_SIZE")
    if not os.environ.get("SUBMITIT_EXECUTOR"):
        tasks = int(os.environ.get("SLURM_NTASKS", "1") or 1)
        if tasks > 1 and world is None:  # srun -n N python train.py, or the batch step of an N-task allocation
            raise UserError(
                f"this process is one of {tasks} SLURM tasks (SLURM_NTASKS) but neither submitit nor torchrun "
                "started it, so there is no rendezvous and each task would train alone into the same folder: "
                "use hydra/launcher=slurm, or one task per node running torchrun, or --ntasks=1"
            )
        return
    import submitit  # started this process (SUBMITIT_EXECUTOR set): the `slurm` extra is installed

    job = submitit.JobEnvironment()
    if job.num_tasks == 1:
        return
    if world is not None:  # exported already (a second call), or torchrun inside each task
        if int(world) < job.num_tasks:  # then not every task is in this process group
            raise UserError(
                f"submitit started this job with {job.num_tasks} tasks but WORLD_SIZE={world}: the tasks would "
                "train in separate process groups; unset WORLD_SIZE and start no torchrun in the tasks (the ranks "
                "come from the job)"
            )
        return
    # MASTER_ADDR: the job's first host (SLURM's node list; the local executor's own host); MASTER_PORT: drawn from
    # the job id, so a requeued job meets on the same port, unless MASTER_PORT is set.
    env = submitit.helpers.TorchDistributedEnvironment()
    try:
        socket.getaddrinfo(env.master_addr, env.master_port)
    except OSError as e:
        raise UserError(
            f"the {job.num_tasks} tasks of submitit job {job.job_id} meet at rank 0's host {env.master_addr}, "
            f"which does not resolve here ({e.strerror}): fix the host name, or run the job with 1 task"
        ) from None
    for name in ("rank", "world_size", "local_rank", "local_world_size", "master_addr", "master_port"):
        os.environ[name.upper()] = str(getattr(env, name))  # RANK, WORLD_SIZE...: torchrun's names
