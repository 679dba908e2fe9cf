"""Warm starts of `python train.py ARGS...` for the tests: a server process imports what train.py imports (torch,
torchvision, Hydra: about 3 s of a short run's 4 to 6) once, then forks a child for each run.

The child is a process of its own, as `python train.py` starts one: its own pid, folder, environment, argv, stdin
from /dev/null, stdout and stderr into files, DataLoader workers and exit code (negative: the signal that ended it),
with train.py run as `__main__` and its folder first on sys.path. It shares with the server the modules already
imported, what they set up as they loaded, and the interpreter's hash seed (str hashes, set order). So
`helpers.run_train` starts a run cold (a new interpreter) when its environment differs from the server's in a
variable that a library reads as it loads (IMPORT_TIME), when it asks for a worker start method of its own, and for
every run under WARM_TRAIN=0 (`WARM_TRAIN=0 pytest`: the whole suite with fresh interpreters).

`python tests/warm_train.py`: the server. It reads one JSON request per line on stdin (folder, environment, argv,
two output files), writes the child's pid, then the child's wait status once it has ended; it ends with its stdin.
"""

import contextlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]
# Read by libraries as they load (OpenMP, MKL, BLAS, the interpreter, the allocator, torch): a run that sets one of
# these otherwise than the server's environment starts cold.
IMPORT_TIME = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "PYTHON", "LD_", "MALLOC_", "TORCH_", "PYTORCH_", "CUDA")


def import_time_vars(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME)}


class WarmTrain:
    """The client side: `run(argv, env, timeout)` -> subprocess.CompletedProcess as subprocess.run(capture_output=True,
    text=True) returns it, or subprocess.TimeoutExpired once the child, killed, has ended."""

    def __init__(self):
        self.env = dict(os.environ)
        self.folder = Path(tempfile.mkdtemp(prefix="warm-train-"))
        self.server = subprocess.Popen([sys.executable, str(Path(__file__).resolve())], cwd=PROJECT, bufsize=0,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip

    def fits(self, env: dict) -> bool:
        """Whether a run with environment `env` may start warm: the variables read at import are the server's."""
        return self.server.poll() is None and import_time_vars(env) == import_time_vars(self.env)

    def run(self, argv: list, env: dict, timeout: float) -> subprocess.CompletedProcess:
        out, err = self.folder / "out", self.folder / "err"
        request = {"cwd": str(PROJECT), "env": env, "argv": argv, "out": str(out), "err": str(err)}
        self.server.stdin.write(json.dumps(request).encode() + b"\n")
        pid = int(self.line(None))
        try:
            status = int(self.line(timeout))
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            self.line(None)
            raise subprocess.TimeoutExpired(argv, timeout, out.read_text(), err.read_text()) from None
        code = os.waitstatus_to_exitcode(status)
        return subprocess.CompletedProcess(argv, code, out.read_text(), err.read_text())

    def line(self, timeout: float | None) -> bytes:
        """The server's next line, read unbuffered: a select() on the pipe sees every byte still to come."""
        text = b""
        while not text.endswith(b"\n"):
            ready, _, _ = select.select([self.server.stdout], [], [], timeout)
            if not ready:
                raise TimeoutError
            byte = self.server.stdout.read(1)
            if not byte:
                raise RuntimeError(f"tests/warm_train.py ended (exit {self.server.wait()})")
            text += byte
        return text


def serve() -> None:
    """A child per request, waited for; the child becomes `python ARGV...` and never comes back here."""
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            become(request)
        print(pid, flush=True)
        print(os.waitpid(pid, 0)[1], flush=True)


def become(request: dict) -> None:
    """In the child: the folder, environment, standard streams and argv of `python ARGV...`, then the script."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    write = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["out"], write), (2, request["err"], write)):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.argv = list(request["argv"])
    script = Path(sys.argv[0]).resolve()
    sys.path[0] = str(script.parent)  # as `python train.py` has it: the script's folder first
    runpy.run_path(str(script), run_name="__main__")
    sys.exit(0)  # the script ran to its end; a SystemExit inside it ends the child with its own code


if __name__ == "__main__":
    sys.path[0] = str(PROJECT)  # started as tests/warm_train.py: import what train.py imports, as train.py would
    import train  # noqa: F401 - the imports each run would otherwise repeat

    serve()
