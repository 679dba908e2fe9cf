"""The train loader's failures mid-run, as the user meets them: one line, a checkpoint of the last finished step,
and an exit code that says what comes next (docs/failures.md has the table): 2 for bad input (errors.UserError),
`EXIT_BAD_SAMPLE` for a sample that cannot be read or transformed, `EXIT_RETRY` for what `resume=latest` goes on
from (a stalled worker, /dev/shm full mid-run): what torchrun's restarts and a SLURM requeue run.

Why each one needs help (pytorch/pytorch#5040, #96629, #108861): a worker that blocks (a dead NFS mount, a
deadlocked decoder) gets PyTorch's bare "DataLoader timed out" naming neither the worker nor where it stands
(`stalled`); a sample that raises comes back as the worker's traceback without the data set index or the file
(`fetch_guarded`); a batch without shared memory fails in the worker, or kills it with SIGBUS (`shm_full`).

Every failure here is raised by the train loader between two steps: the model, the optimizer and the loader's
position all stand at the last finished step, so `save_on_failure` writes a checkpoint that resumes exactly.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
from torch.utils.data import DataLoader

from .errors import UserError, causes, reason, user_trace

EXIT_BAD_SAMPLE = 3  # the data has a bad sample: restarting as is meets it again
EXIT_RETRY = 75  # sysexits' EX_TEMPFAIL: the run can go on from its checkpoint (resume=latest) once restarted
SHM_DIR = "/dev/shm"  # where torch's shared memory lives on Linux (shm_open names files there)
STALL_STACKS = "stall_stacks.txt"  # in the run folder: every train worker's Python stack when a stall fired
BAD_SAMPLES = "bad_samples.txt"  # in the run folder: the samples data.on_bad_sample=skip dropped
# The signal that makes a worker write its stack: a real-time one nobody else sends (USR1/USR2 are preemption
# signals here, and a whole process group gets those). None where there are no real-time signals (macOS).
STACK_SIGNAL = signal.SIGRTMIN + 2 if hasattr(signal, "SIGRTMIN") else None
STACK_WAIT_S = 3.0  # how long `stalled` waits for the workers' stacks


class LoaderFailure(UserError):
    """The train loader cannot go on (a stall, /dev/shm full, a bad sample): the one line (save_on_failure adds what
    it did about a checkpoint)."""

    exit_code = EXIT_RETRY
    stacks = ""  # a stall's: the workers' Python stacks as faulthandler wrote them, the stuck one's first


class BadSample(LoaderFailure):
    """A sample raised while it was read or transformed. Built from one string only, so that PyTorch can rebuild
    it in the main process from a worker's exception (ExceptionWrapper.reraise calls `type(message)`)."""

    exit_code = EXIT_BAD_SAMPLE


# --- bad samples (in the worker) --------------------------------------------------------------------------------


class Samples(list):
    """A batch's samples as fetched, the ones `data.on_bad_sample=skip` left out (`skipped`: their lines, as
    fetch_guarded words them), or what made the batch fail (`failed`): the collate hands them to the main
    process."""

    def __init__(self, samples, skipped=(), failed: Exception | None = None):
        super().__init__(samples)
        self.skipped = list(skipped)
        self.failed = failed


def fetch_guarded(dataset, indices, skip: bool, fetch=None) -> Samples:
    """The samples of one batch, each fetched under a try (by `fetch(index)`, e.g. seeded, else `dataset[index]`):
    a sample that raises becomes a BadSample, one line (`data set index 17 (file a/b.png): OSError: image file is
    truncated`; where it comes from is the data set's `sample_source(index)` to say: ImageFiles gives the
    file{% if cookiecutter.with_shards == "yes" %}, ShardDataset the shard and member{% endif %}), or with `skip` is left out and listed. A batch with no good
    sample left is refused either way: that is a broken transform far more often than a broken data set. The
    failure is the batch's `failed`, raised as one line when the loop takes the batch (`named`)."""
    samples = []
    skipped = []
    for index in indices:
        try:
            samples.append(dataset[index] if fetch is None else fetch(index))
        except UserError as e:  # the data set's own one-line message (e.g. a shard that changed): it stands as it is
            return Samples([], failed=e)
        except Exception as e:
            source = ""
            with contextlib.suppress(Exception):  # a description that fails must not hide the sample's own error
                source = f" ({dataset.sample_source(index)})"  # a data set without one names no source
            # a loader=auto trial's Probe names the data set's index
            at = dataset.data_index(index) if hasattr(dataset, "data_index") else index
            line = f"data set index {at}{source}: {reason(e)}"[:500]
            if not skip:
                failed = BadSample(line)
                failed.trace = user_trace(e)  # text: it travels from the worker with the batch's note
                return Samples([], failed=failed)
            skipped.append(line)
    if not samples:
        return Samples([], failed=BadSample(f"every sample of a batch failed, e.g. {skipped[-1]}: check the data "
                                            "set's transform"))  # fmt: skip
    return Samples(samples, skipped)


# --- stalls -----------------------------------------------------------------------------------------------------


def arm_stack_dump(stack_dir: str | None, worker_id: int) -> None:
    """Worker side (worker_init_fn): write this process's Python stack, every thread, into
    `<stack_dir>/<worker_id>-<pid>.txt` (which worker has which pid) when STACK_SIGNAL comes. faulthandler writes
    from its C signal handler, so a worker stuck in a read or a lock still answers."""
    if stack_dir is None or STACK_SIGNAL is None:
        return
    out = os.open(os.path.join(stack_dir, f"{worker_id}-{os.getpid()}.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    faulthandler.register(STACK_SIGNAL, file=out, all_threads=True, chain=False)  # the descriptor: open for good


def stalled(loader) -> LoaderFailure:
    """The line for a `loader.timeout` that fired in `loader` (a TrainLoader{% if cookiecutter.with_streams == "yes" %} or StreamLoader{% endif %}) while it waited for
    its next batch, and the workers' Python stacks.

    Which worker holds that batch follows from the loader's own order (`worker_due()`): batches go to the workers
    round-robin (torch/utils/data/dataloader.py); its stack comes first. STACK_SIGNAL goes only to live children
    that armed a stack dump: any other process dies of a real-time signal. The stuck worker is ended with the others
    as the process exits (its parent's SIGTERM)."""
    asked = {}  # worker id -> (pid, the file it writes its stack into)
    live = {child.pid for child in psutil.Process().children()}
    for path in Path(loader.stack_dir).glob("*-*.txt") if loader.stack_dir is not None else []:  # armed workers
        worker_id, pid = map(int, path.stem.split("-"))
        with contextlib.suppress(ProcessLookupError):  # gone meanwhile
            if pid in live:
                os.kill(pid, STACK_SIGNAL)
                asked[worker_id] = (pid, path)
    # faulthandler writes in one go but marks no end: files that stopped growing for a moment are complete
    deadline = time.monotonic() + STACK_WAIT_S
    sizes = None
    while asked and time.monotonic() < deadline:
        time.sleep(0.1)
        now = [path.stat().st_size for _, path in asked.values()]
        if all(now) and now == sizes:
            break
        sizes = now
    due = loader.worker_due()
    holder = f"DataLoader worker {due}" + (f" (pid {asked[due][0]})" if due in asked else "")
    failure = LoaderFailure(
        f"loader.timeout: no batch for {loader.settings.timeout:g} s: batch {loader.position} of epoch "
        f"{loader.epoch} is made by {holder}, which is stuck (a hung read, a dead network mount, a deadlock in a "
        "decoder?)"
    )
    empty = f"(no stack written within {STACK_WAIT_S:g} s)\n"  # slow to answer
    for worker_id in sorted(asked, key=lambda worker_id: worker_id != due):  # the stuck worker's stack first
        pid, path = asked[worker_id]
        failure.stacks += f"--- DataLoader worker pid {pid} ---\n{path.read_text() or empty}\n"
    return failure


# --- /dev/shm full, a dead worker -------------------------------------------------------------------------------

SHM_FULL = 0.05  # /dev/shm with less free than this share of its size, as the loader fails: full


def shm_full() -> LoaderFailure | None:
    """The line for a loader failure when /dev/shm is full now (a check of its space, whatever the error says:
    a worker's failed allocation, its SIGBUS); else None."""
    free, size = shm_space() or (0, 0)  # none (macOS, Windows) or a size of 0: not full
    if free >= SHM_FULL * size:
        return None
    used = size - free
    return LoaderFailure(
        f"{SHM_DIR} is {used / size:.0%} full ({used / 2**20:.1f} of {size / 2**20:.1f} MiB used): a DataLoader "
        f"worker found no room for a batch there; something besides this run's batches filled it (see `du -sh "
        f"{SHM_DIR}/*`), or it is too small: free it or give it more room (docker run --shm-size=1g), or lower "
        "loader.num_workers / loader.prefetch_factor, then resume=latest"
    )


def exit_status(pid: int) -> str | None:
    """How a child process ended, without reaping it ("killed by signal 9 (SIGKILL)"); None while it runs."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except (AttributeError, OSError):  # already reaped (ChildProcessError: a normal shutdown), or not POSIX
        return None
    if info is None:
        return None
    if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
        return f"killed by signal {info.si_status} ({signal.Signals(info.si_status).name})"
    return f"exited with code {info.si_status}"


class WorkerDied(RuntimeError):
    """A train loader worker is gone while the run still needs it (monitor.py's check between readings, or a
    read of the loader that failed as it died): how it ended, and what to do."""

    def __init__(self, how: str):
        super().__init__(
            f"{how.rstrip('. ')}. A SIGKILL is most often the kernel's out-of-memory killer (dmesg shows it): lower "
            "loader.num_workers or loader.prefetch_factor, or set loader.max_prefetch_mib; for any other end, rerun "
            "with loader.num_workers=0 to see the error in the main process"
        )


def ended_worker(pids=None, wait_s: float = 0.0) -> WorkerDied | None:
    """A WorkerDied for a process of `pids` (default: every child of this process) that has ended, not reaped yet
    ("DataLoader worker (pid N) killed by signal 9 (SIGKILL). A SIGKILL ..."), waiting up to `wait_s` for one on its
    way out; None if none has."""
    deadline = time.monotonic() + wait_s
    while True:
        for pid in sorted(pids) if pids is not None else [child.pid for child in psutil.Process().children()]:
            if status := exit_status(pid):
                return WorkerDied(f"DataLoader worker (pid {pid}) {status}")
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def dead_worker(pids, error: BaseException) -> WorkerDied | None:
    """A WorkerDied when a worker of `pids` (the train loader's this epoch) has ended as a read of its loader
    failed with `error`: how it ended, or, once PyTorch has reaped it (the kernel forgets how), PyTorch's own
    first line; None while they all run."""
    if died := ended_worker(pids, wait_s=2.0):  # a read can fail as the worker dies: give it time to end
        return died
    if all(psutil.pid_exists(pid) for pid in pids):
        return None
    return WorkerDied((str(error).strip().splitlines() or [type(error).__name__])[0])


def worker_death(exc: BaseException) -> str | None:
    """The line of a dead DataLoader worker behind `exc`: a WorkerDied in its chain, or an error that came as
    a child process ended, not reaped yet (PyTorch's SIGCHLD handler raises one wherever the loop is); else
    None."""
    for link in causes(exc):
        if isinstance(link, WorkerDied):
            return str(link)
        if isinstance(link, (RuntimeError, ConnectionError, EOFError)) and (died := ended_worker()):
            return str(died)
    return None


# --- in the main process ----------------------------------------------------------------------------------------


def named(batches, loader):
    """`batches` of `loader` (the train loader, or validation's DataLoader), a failure of the loader's own
    raised as its one line: a stall (`loader.timeout` reached: the wait for the batch is timed here; `stalled`
    for the train loader), a full /dev/shm, a dead train worker; a train batch's `failed` (a bad sample, a
    data set's UserError) raised as it is. Validation's workers raise theirs as PyTorch rebuilds them: their
    type (their exit code), the worker's traceback. No checkpoint from here: save_on_failure makes the train
    loader's."""
    validation = isinstance(loader, DataLoader)
    timeout = loader.timeout if validation else loader.settings.timeout
    asked = time.monotonic()
    try:
        # what the loop's body raises stays out there (it runs past the yield): only the loader's own errors come here
        for batch in batches:
            if not validation and batch[1].failed is not None:  # a train batch that failed where it was made
                raise batch[1].failed
            yield batch
            asked = time.monotonic()
    except UserError:
        raise
    except Exception as e:
        waited = time.monotonic() - asked
        if timeout and waited >= timeout:
            failure = stalled(loader) if not validation else LoaderFailure(
                f"loader.timeout: no validation batch for {waited:.0f} s: a worker is stuck (a hung read, a dead "
                "network mount?)"
            )  # fmt: skip
        else:
            failure = shm_full() or (None if validation else dead_worker(loader.worker_pids, e))
        if failure is None:
            raise
        raise failure from e


@contextlib.contextmanager
def save_on_failure(run):
    """Around the loop's batches: a LoaderFailure comes between two steps, so the run is saved as it stands (the
    last finished step), and the stall's stacks go into the run folder. Under torchrun the other ranks are inside
    a collective and cannot join a save: the run continues from its last checkpoint instead."""
    try:
        yield
    except LoaderFailure as failure:
        notes = [failure.args[0].rstrip()]  # a worker's traceback ends in a newline
        if failure.stacks and run.world.is_main:
            path = run.run_dir / STALL_STACKS
            path.write_text(failure.stacks)
            notes.append(f"the workers' Python stacks are in {path}")
        if run.world.distributed:
            notes.append(
                "no checkpoint now under torchrun (the other ranks wait in a collective): resume=latest "
                "goes on from the last one"
            )
        else:
            run.checkpoints.save(run)
            notes.append(f"checkpoint of step {run.step} saved: {run.checkpoints.last}")
        failure.args = ("; ".join(notes),)
        raise


@dataclass
class BadSampleLog:
    """`bad_samples.txt` in the run folder: one line per skipped sample, `epoch<TAB>rank<TAB>what`, written when the
    loop consumes its batch (not when a worker makes it ahead), each (epoch, rank, sample) once: a resumed run
    that consumes the batch again does not list it twice."""

    path: Path
    rank: int = 0
    seen: set | None = None  # the file's lines, read at the first add

    def add(self, epoch: int, lines: list[str]) -> None:
        if self.seen is None:
            self.seen = set(self.path.read_text().splitlines()) if self.path.exists() else set()
        new = [entry for entry in (f"{epoch}\t{self.rank}\t{line}" for line in lines) if entry not in self.seen]
        self.seen.update(new)
        with open(self.path, "a") as f:  # short appends: ranks writing at once do not interleave lines
            f.writelines(line + "\n" for line in new)


def shm_space() -> tuple[int, int] | None:
    """(free bytes, size in bytes) of the file system holding torch's shared memory; None where there is none
    (macOS, Windows: shared memory is not a file system there)."""
    try:
        st = os.statvfs(SHM_DIR)
    except (OSError, AttributeError):
        return None
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
