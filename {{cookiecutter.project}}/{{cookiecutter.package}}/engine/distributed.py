"""Data-parallel processes with PyTorch's own engine: `torchrun` sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR,
we join the process group (gloo on CPU, nccl on CUDA). A submitit job of several tasks (Hydra's
`hydra/launcher=slurm` or `submitit_local`) gets the same variables from submitit's job environment
(`adopt_job_ranks`), so its N tasks are one N-rank run. Without either every helper here is a
no-op, so `python train.py` stays one plain process."""

from __future__ import annotations

import logging
import os
import socket
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .errors import UserError
from .preempt import StopRequest

log = logging.getLogger(__name__)

# Seconds a rank asked to stop (SIGTERM) still waits in a collective for its peers before it exits:
# live peers come within a step, a dead one never does (preempt.py).
COLLECTIVE_GRACE_S = 10.0
# Off only to show, in the tests, what the elastic-restart fixes below prevent.
WORKAROUNDS = os.environ.get("ELASTIC_WORKAROUNDS", "on") != "off"
# Off only to show, in the tests, the resumed steps that differ in the last bits with 3 or more ranks (fix_buckets).
BUCKET_WORKAROUND = os.environ.get("DDP_BUCKET_WORKAROUND", "on") != "off"


@dataclass(frozen=True)
class World:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def job_ranks() -> dict[str, str]:
    """torchrun's variables for this process when submitit started it as one of N > 1 tasks, {} when there is
    nothing to add (one task, torchrun, a plain process). N tasks that cannot meet are refused (UserError): without
    a rendezvous each task would train alone, all of them into the same run folder and checkpoint files."""
    world = os.environ.get("WORLD_SIZE")
    if not os.environ.get("SUBMITIT_EXECUTOR"):
        tasks = int(os.environ.get("SLURM_NTASKS", "1") or 1)
        if tasks > 1 and world is None:  # srun -n N python train.py, or the batch step of an N-task allocation
            raise UserError(
                f"this process is one of {tasks} SLURM tasks (SLURM_NTASKS) but neither submitit nor torchrun "
                "started it, so there is no rendezvous and each task would train alone into the same folder: "
                "use hydra/launcher=slurm, or one task per node running torchrun, or --ntasks=1"
            )
        return {}
    import submitit  # it started this process (SUBMITIT_EXECUTOR: "slurm" or "local")

    job = submitit.JobEnvironment()
    if job.num_tasks == 1:
        return {}
    if world is not None:  # exported already (a second call), or torchrun inside each task
        if int(world) < job.num_tasks:  # then not every task is in this process group
            raise UserError(
                f"submitit started this job with {job.num_tasks} tasks but WORLD_SIZE={world}: the tasks would "
                "train in separate process groups; unset WORLD_SIZE and start no torchrun in the tasks (the ranks "
                "come from the job)"
            )
        return {}
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
    ranks = {"RANK": env.rank, "WORLD_SIZE": env.world_size, "LOCAL_RANK": env.local_rank}
    ranks.update(LOCAL_WORLD_SIZE=env.local_world_size, MASTER_ADDR=env.master_addr, MASTER_PORT=env.master_port)
    return {name: str(value) for name, value in ranks.items()}


def adopt_job_ranks() -> None:
    """Export `job_ranks()`: first thing in train(), as everything after reads torchrun's variables (join, the
    dry step's device, the share of /dev/shm per host, preempt.py's exit message).

    Not submitit's own `export()`: it also narrows CUDA_VISIBLE_DEVICES to the local rank's number, after which
    `cuda:<local rank>` does not exist on any rank but 0; here, as under torchrun, each rank takes
    `cuda:<local rank>` of the GPUs the job sees."""
    os.environ.update(job_ranks())


def join(device: torch.device) -> World:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return World()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise UserError(
                f"rank {rank} wants cuda:{local_rank} but {torch.cuda.device_count()} GPUs are visible to it: "
                "lower torchrun's --nproc_per_node (hydra.launcher.tasks_per_node under submitit), one process per "
                "GPU, each process seeing all of its node's GPUs"
            )
        torch.cuda.set_device(local_rank)
    # torchrun's env:// rendezvous hands every restart attempt the agent's same store, and the new process group
    # reads keys the failed attempt left there: gloo's connectFullMesh then dials a killed rank's old port and the
    # restart fails (pytorch/pytorch#167288 reports the NCCL form). Each attempt gets its own namespace.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    log.info("rank %d of %d: joining the process group (attempt %s)", rank, world_size, attempt)
    with StopRequest.waiting_on_peers(0.0) if WORKAROUNDS else nullcontext():  # a SIGTERM while joining: exit at once
        store, rank, world_size = next(dist.rendezvous("env://"))
        if WORKAROUNDS:
            store = dist.PrefixStore(f"attempt{attempt}/", store)
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", store=store, rank=rank, world_size=world_size
        )
    return World(rank, world_size, local_rank)


def rank_device(device: torch.device, world: World) -> torch.device:
    return torch.device("cuda", world.local_rank) if device.type == "cuda" and world.distributed else device


def wrap(model: torch.nn.Module, device: torch.device, world: World) -> torch.nn.Module:
    if not world.distributed:
        return model
    ids = [device.index] if device.type == "cuda" else None
    net = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    if BUCKET_WORKAROUND:
        fix_buckets(net)
    return net


def fix_buckets(net: torch.nn.parallel.DistributedDataParallel) -> None:
    """Give DDP its final gradient buckets now, before the first step, so that every process of a run, fresh or
    resumed, all-reduces each step's gradients in the same layout.

    DDP starts with one bucket in parameter order and, at the start of its second step, rebuilds the buckets once in
    the order the gradients became ready in its first (Reducer::rebuild_buckets, called from DDP's forward). A
    resumed process takes its first step in the start layout where the uninterrupted one has rebuilt already. With
    3 or more ranks gloo's ring all-reduce (NCCL's too splits a bucket into chunks) adds the ranks' values in an
    order that depends on an element's place in the flat bucket, so the layout changes the last bits of the averaged
    gradients (pytorch/pytorch#30509: the bucket size changes the gradients' bits); with 2 ranks a + b == b + a.

    Here a throwaway backward of zeros, through no module, makes the gradients ready in reverse definition order
    (output layers first, as a real backward roughly does, so the all-reduces still overlap the backward), and the
    reducer rebuilds from that order at once. Weights, buffers, RNG and data are not touched; gradients are put back
    as they were. It costs one all-reduce of the model's size here and nothing per step. A collective: every rank
    calls it, inside `wrap`."""
    sparse = (torch.nn.Embedding, torch.nn.EmbeddingBag)
    if any(isinstance(m, sparse) and m.sparse for m in net.module.modules()):  # a dense zero grad would be refused
        log.warning(
            "DDP: sparse embeddings, gradient buckets left to DDP: a resume with 3+ ranks may differ in the last bits"
        )
        return
    params = [p for p in net.module.parameters() if p.requires_grad]
    kept = [p.grad for p in params]
    for p in params:
        p.grad = None  # the reducer would write the averaged zeros into an existing gradient in place
    chain = params[0].new_zeros(())
    for p in params:  # autograd runs the newest node first: the last parameter's gradient is ready first
        chain = chain + p.sum() * 0
    net.reducer.prepare_for_backward([])  # what DDP's forward does: the reducer now expects every parameter's hook
    chain.backward()  # the hooks record the order, all-reduce the zeros and finish the backward
    for p, grad in zip(params, kept):
        p.grad = grad
    net.reducer._rebuild_buckets()  # in that order, from rank 0's; DDP's forward never rebuilds again


def sum_all(tensor: torch.Tensor, world: World | None) -> list[float]:
    """Element-wise sum over ranks of a 1-d tensor (in place), read to the host; in one process, just the read.

    The read stays inside the grace window: with NCCL the all-reduce is queued and the read is where a rank
    waits for its peers."""
    if world is None or not world.distributed:
        return tensor.tolist()
    with StopRequest.waiting_on_peers(COLLECTIVE_GRACE_S):
        dist.all_reduce(tensor)
        return tensor.tolist()


def gather_to_main(obj, world: World) -> list | None:
    """Every rank's `obj` on rank 0 (a list indexed by rank), None elsewhere."""
    if not world.distributed:
        return [obj]
    out = [None] * world.world_size if world.is_main else None
    with StopRequest.waiting_on_peers(COLLECTIVE_GRACE_S):
        dist.gather_object(obj, out, dst=0)
    return out


def barrier(world: World) -> None:
    if world.distributed:
        with StopRequest.waiting_on_peers(COLLECTIVE_GRACE_S):
            dist.barrier()


def leave(world: World) -> None:
    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()
