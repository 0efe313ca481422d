"""kill -9 of a trainer that has saved a checkpoint leaves no process of its behind (megatron's
forked per-bucket checkpoint writers can block forever on their results pipe when the trainer dies
mid-save; megatron's own results queue would keep a multiprocessing Manager server, and with it a
resource tracker, running for the life of the trainer)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import FAST, cli_env

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux only)")]


def _session(sid: int) -> dict[int, str]:
    """{pid: command line} of every live process of session `sid` (zombies left out)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, pgrp, session
        if fields[0] != "Z" and int(fields[3]) == sid:
            found[int(entry.name)] = cmd
    return found


def test_kill_after_checkpoint_leaves_no_processes(tmp_path):
    args = [*FAST, "train.save_interval=2", "train.train_iters=200", f"checkpoint.run_dir={tmp_path}"]
    p = subprocess.Popen(
        [sys.executable, "-m", "loongforge.llm.cli", "train", "tiny", *args],
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # leads its own session: everything it starts shares its session id
    )
    try:
        latest = tmp_path / "checkpoints" / "latest"
        deadline = time.time() + 300
        while not latest.exists() and time.time() < deadline and p.poll() is None:
            time.sleep(0.05)
        assert latest.exists(), f"no checkpoint (exit status {p.poll()})"
        os.kill(p.pid, signal.SIGKILL)  # the trainer alone, not its process group
        p.wait()
        # the trainer's children exit on their own: megatron's forked checkpoint writers once their
        # write (with fsync) ends; on a loaded 2-core CI machine that took over 10 s once
        deadline = time.time() + 60
        while (left := _session(p.pid)) and time.time() < deadline:
            time.sleep(0.1)
        assert not left, "outlived the trainer:\n" + "\n".join(f"{pid}: {cmd}" for pid, cmd in sorted(left.items()))
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        for pid in _session(p.pid):  # don't leave them running after a failure
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


_FORKER = """
import os, sys, time, multiprocessing as mp
from loongforge.core.checkpoint.megatron_io import writers_die_with_this_process

def sleeper(path):
    open(path, "w").write(str(os.getpid()))
    time.sleep(120)

if __name__ == "__main__":
    ctx = mp.get_context("fork")
    if sys.argv[2] == "saving":
        with writers_die_with_this_process():
            ctx.Process(target=sleeper, args=(sys.argv[1],)).start()
    else:
        ctx.Process(target=sleeper, args=(sys.argv[1],)).start()
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.01)
    time.sleep(0.2)
    os.kill(os.getpid(), 9)  # the trainer killed mid-save
"""


@pytest.mark.parametrize("saving", [True, False])
def test_processes_forked_while_saving_die_with_the_trainer(tmp_path, saving):
    """A process forked inside `writers_die_with_this_process` (megatron's checkpoint writers)
    is killed when its parent is; one forked outside it (the negative control) lives on."""
    script = tmp_path / "forker.py"
    script.write_text(_FORKER)
    pid_file = tmp_path / "child.pid"
    subprocess.run([sys.executable, str(script), str(pid_file), "saving" if saving else "plain"], env=cli_env(), timeout=120)
    child = int(pid_file.read_text())
    try:
        deadline = time.time() + 10
        while _alive(child) and time.time() < deadline:
            time.sleep(0.05)
        assert _alive(child) != saving
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return False
    return fields[0] != "Z"
