"""A fork server for the tests' CLI runs.

Every CLI process imports torch, megatron-core and transformers before it does anything: about
ten seconds of CPU on a 2-core machine, more than most tiny runs take to train. The server is one
process (per pytest process) that imports those third-party modules once and then forks a child
for each `python -m MODULE ARGS` run. The child takes the run's working directory, environment,
stdin (/dev/null), stdout and stderr (files), reseeds the generators a fresh interpreter seeds from
the OS, puts the working directory first on sys.path and runs the module as `-m` does (runpy, as
`__main__`); then it finishes as an interpreter does (non-daemon threads joined, atexit handlers,
streams flushed) and exits with the run's status. Our own packages are not preloaded: each run
imports them as a fresh process would.

The client (`ForkServer.start`) uses the server only where that is the same as a fresh process:
the run's environment equals the server's but for variables read at run time only (`RUN_TIME_KEYS`),
and the server has one thread after its imports (a forked thread pool would hang the child).
Anything else gets a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

PRELOAD = (
    "torch",
    "torch.distributed",
    "megatron.core",
    "megatron.core.models.gpt",
    "megatron.core.dist_checkpointing",
    "megatron.core.optimizer",
    "transformers",
    "transformers.modeling_utils",
    "safetensors.torch",
    "numpy",
    "yaml",
    "omegaconf",
)

# Variables no preloaded module reads at import, in which a forked child may differ from the server:
# torchrun's worker variables (read when the process group is set up), pytest's name of the running
# test, the inductor cache directory (set in os.environ by inductor's first compile in a process,
# read at compile time) and Transformer Engine's NVTE_ variables (set by megatron when it builds a
# language model, read then)
RUN_TIME_KEYS = frozenset(
    {
        "PYTEST_CURRENT_TEST",
        "TORCHINDUCTOR_CACHE_DIR",
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_NAME",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    }
)


class ForkedProcess:
    """The part of `subprocess.Popen` the tests' launcher uses, for a child of the server: its exit
    status comes from the file the server writes when it reaps the child."""

    def __init__(self, pid: int, status_path: Path):
        self.pid, self._status_path, self.returncode = pid, status_path, None

    def poll(self) -> int | None:
        if self.returncode is None and self._status_path.exists():
            self.returncode = int(self._status_path.read_text())
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait(self) -> int:
        while self.poll() is None:
            time.sleep(0.02)
        return self.returncode


class ForkServer:
    def __init__(self, env: dict):
        self.env = dict(env)
        self._proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve())], env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        ready = json.loads(self._proc.stdout.readline() or "{}")
        self.usable = ready.get("threads") == 1

    def can_run(self, env: dict) -> bool:
        if not self.usable or self._proc.poll() is not None:
            return False
        keys = {k for k in set(env) | set(self.env) if k not in RUN_TIME_KEYS and not k.startswith("NVTE_")}
        return all(env.get(k) == self.env.get(k) for k in keys)

    def start(self, module: str, args: list[str], cwd: Path | None, env: dict, out: Path, err: Path) -> ForkedProcess:
        status = out.with_suffix(".status")
        req = {
            "module": module,
            "args": args,
            "cwd": str(cwd or os.getcwd()),
            "env": env,
            "out": str(out),
            "err": str(err),
            "status": str(status),
        }
        self._proc.stdin.write(json.dumps(req) + "\n")
        self._proc.stdin.flush()
        reply = json.loads(self._proc.stdout.readline())
        return ForkedProcess(reply["pid"], status)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            self._proc.wait(timeout=30)


# ---- the server process ----


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def _output_stream(fd: int, encoding: str, **kw):
    """The text stream an interpreter opens on `fd` (unbuffered under PYTHONUNBUFFERED)."""
    import io

    raw = io.FileIO(fd, "w", closefd=False)
    if os.environ.get("PYTHONUNBUFFERED"):
        return io.TextIOWrapper(raw, encoding=encoding, write_through=True, **kw)
    return io.TextIOWrapper(io.BufferedWriter(raw), encoding=encoding, **kw)


def _run_child(req: dict, reply_fd: int) -> None:
    import atexit
    import io
    import random
    import runpy
    import threading

    os.close(reply_fd)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, req["out"]), (2, req["err"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    enc = sys.stdout.encoding
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding=enc)
    sys.stdout = sys.__stdout__ = _output_stream(1, enc)
    sys.stderr = sys.__stderr__ = _output_stream(2, enc, errors="backslashreplace", line_buffering=True)
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    sys.path[0] = os.getcwd()
    sys.argv = [req["module"], *req["args"]]
    code = 0
    try:
        runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    except SystemExit as e:
        code = _exit_code(e)
    finally:
        for s in (sys.stdout, sys.stderr):
            try:
                s.flush()
            except Exception:
                pass
        os._exit(code)


def serve() -> None:
    import importlib

    reply_fd = os.dup(1)
    os.dup2(2, 1)  # whatever the imports print goes to stderr, not into the replies
    for name in PRELOAD:
        importlib.import_module(name)

    def reply(msg: dict) -> None:
        os.write(reply_fd, (json.dumps(msg) + "\n").encode())

    reply({"threads": len(os.listdir("/proc/self/task"))})
    pending: dict[int, str] = {}
    buf = b""
    while True:
        ready, _, _ = select.select([0], [], [], 0.02)
        while pending:
            pid, st = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            path = pending.pop(pid)
            Path(path + ".tmp").write_text(str(os.waitstatus_to_exitcode(st)))
            os.replace(path + ".tmp", path)
        if not ready:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _run_child(req, reply_fd)
            pending[pid] = req["status"]
            reply({"pid": pid})


if __name__ == "__main__":
    serve()
