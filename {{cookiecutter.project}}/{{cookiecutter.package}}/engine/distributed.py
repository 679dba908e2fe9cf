"""Data-parallel processes with PyTorch's own engine: `torchrun` sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR,
we join the process group (gloo on CPU, nccl on CUDA). Without torchrun every helper here is a
no-op, so `python train.py` stays one plain process."""

from __future__ import annotations

import logging
import os
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


def join(device: torch.device) -> World:
    if "WORLD_SIZE" not in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        # Several SLURM tasks started by submitit (hydra/launcher=slurm): it knows the rendezvous, torchrun is not used.
        import submitit

        submitit.helpers.TorchDistributedEnvironment().export()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return World()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise UserError(
                f"rank {rank} wants cuda:{local_rank} but {torch.cuda.device_count()} GPUs are visible: "
                "lower --nproc_per_node"
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
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)


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
