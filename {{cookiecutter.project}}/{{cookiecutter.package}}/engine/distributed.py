"""Data-parallel processes with PyTorch's own engine: `torchrun` sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR,
we join the process group (gloo on CPU, nccl on CUDA). Without it every helper here is a no-op, so
`python train.py` stays one plain process."""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .errors import UserError
from .preempt import StopRequest

COLLECTIVE_GRACE_S = 10.0  # a rank asked to stop waits this long on its peers: live ones come within a step


@dataclass(frozen=True)
class World:
    rank: int = 0
    world_size: int = 1
    stop: StopRequest | None = field(default=None, compare=False)  # the run's, which ends a wait on dead peers

    def waiting(self, grace: float = COLLECTIVE_GRACE_S):
        """Around a collective: a SIGTERM during it ends this process after `grace` s (when `stop` watches)."""
        return contextlib.nullcontext() if self.stop is None else self.stop.waiting_on_peers(grace)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def join_early(device: torch.device) -> World:
    """`join` for the checks before the run (preflight.py), when a launcher started this process: torchrun, or a
    SLURM job's tasks (MASTER_ADDR set); else the one process of a plain run, which joins nothing."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 or "MASTER_ADDR" not in os.environ:
        return World()
    return join(device)


{% if cookiecutter.with_fsdp == "yes" %}
def join(device: torch.device, group_of_one: bool = False, stop: StopRequest | None = None) -> World:
    """This process's rank in the torchrun job (after joining its process group), or the one process of a plain run.
    `group_of_one`: a plain run joins a process group of its own too (FSDP shards over a group, even of one). The
    group joined before the run's checks (`join_early`) is the run's."""
{% else %}
def join(device: torch.device, stop: StopRequest | None = None) -> World:
    """This process's rank in the torchrun job (after joining its process group), or the one process of a plain run.
    The group joined before the run's checks (`join_early`) is the run's."""
{% endif %}
    world_size, backend = int(os.environ.get("WORLD_SIZE", "1")), "nccl" if device.type == "cuda" else "gloo"
    if world_size == 1:
{% if cookiecutter.with_fsdp == "yes" %}
        if group_of_one and not dist.is_initialized():
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
{% endif %}
        return World()
    if dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size(), stop)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise UserError(
                f"rank {rank} wants cuda:{local_rank} but {torch.cuda.device_count()} GPUs are visible to it: "
                "lower torchrun's --nproc_per_node{% if cookiecutter.with_slurm == "yes" %} (hydra.launcher.tasks_per_node under submitit){% endif %}, one process per "
                "GPU, each process seeing all of its node's GPUs"
            )
        torch.cuda.set_device(local_rank)
    # torchrun's env:// rendezvous hands every restart attempt the agent's same store, and the new process group
    # reads keys the failed attempt left there: gloo's connectFullMesh then dials a killed rank's old port and the
    # restart fails (pytorch/pytorch#167288 reports the NCCL form). Each attempt gets its own namespace.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    # on stderr: the ranks join before the run's log file exists (preflight.py), and a rank left waiting on a peer
    # that never comes shows here which one it is
    print(f"rank {rank} of {world_size}: joining the process group (attempt {attempt})", file=sys.stderr, flush=True)
    with World(stop=stop).waiting(0.0):  # a SIGTERM while joining: exit at once
        store, rank, world_size = next(dist.rendezvous("env://"))
        store = dist.PrefixStore(f"attempt{attempt}/", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    return World(rank, world_size, stop)


def wrap(model: nn.Module, device: torch.device, world: World) -> nn.Module:
    if not world.distributed:
        return model
    ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids)


def settle_buckets(net: nn.Module, throwaway_loss, undone) -> None:
    """Give DDP its final gradient buckets before the first real step, so that every process of a run, fresh or
    resumed, all-reduces each step's gradients in the same layout (with 3 or more ranks the layout changes the last
    bits of the averaged gradients: docs/distributed.md). A collective: every rank calls it.

    DDP rebuilds its buckets once, at the forward after its first backward: so one throwaway step,
    `throwaway_loss()` (the task's loss on two training samples) and its backward, inside `undone` (a context that
    puts back what it changes: dry_step.undone); no optimizer step runs."""
    if isinstance(net, nn.parallel.DistributedDataParallel):
        with undone:
            throwaway_loss().backward()


def all_reduce(tensor: torch.Tensor, world: World | None, op=dist.ReduceOp.SUM) -> list[float]:
    """Element-wise sum (or `op`) over ranks of a 1-d tensor (in place), read to the host; in one process, just the
    read. The read stays inside the grace window: with NCCL it is where a rank waits for its peers."""
    if world is None or not world.distributed:
        return tensor.tolist()
    with world.waiting():
        dist.all_reduce(tensor, op=op)
        return tensor.tolist()


{% if cookiecutter.with_fsdp == "yes" %}
def most(count: int, world: World | None, device: torch.device) -> int:
    """The largest `count` over ranks (read to the host)."""
    return int(all_reduce(torch.tensor([count], device=device), world, dist.ReduceOp.MAX)[0])


{% endif %}
def main_buffers(model: nn.Module, world: World | None) -> None:
    """Rank 0's buffers (BatchNorm's running statistics) on every rank. Each rank's last training forward updated
    them from its own batch; DDP hands rank 0's out again only at the next forward. A validation before that would
    judge a mix of ranks' statistics, not the weights the checkpoint keeps (rank 0's). Training is unchanged."""
    if world is None or not world.distributed:
        return
    with world.waiting(), torch.no_grad():
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)


def gather_all(obj, world: World) -> list:
    """Every rank's `obj` on every rank, indexed by rank (small objects: a run folder, a refusal, RNG states). Also
    the barrier: `gather_all(None, world)` returns once every rank has called it."""
    if not world.distributed:
        return [obj]
    out = [None] * world.world_size
    with world.waiting():
        dist.all_gather_object(out, obj)
    return out


def leave(world: World) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def refuse(error: str, world: World | None = None, quiet: bool = False, trace: str = "", code: int = 2):
    """Exit with `code` (2: bad input), saying `error` in one line, after `trace` (your code's traceback), unless
    `quiet` (another rank says it). With `world`, every rank at once: rank 0 says it, and no rank exits before it
    has, since torchrun stops the other ranks as soon as one exits; the ranks then leave their group (a rank leaving
    a live gloo group as its peer exits can abort, SIGABRT)."""
    if not quiet and (world is None or world.is_main):
        print(f"{trace}error: {error}", file=sys.stderr, flush=True)
    if world is not None:
        gather_all(None, world)
        leave(world)
    sys.exit(code)
