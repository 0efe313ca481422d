"""The tests' fork server (tests/cli_forkserver.py) runs a CLI as a fresh interpreter does: same
outputs, exit status, losses, sys.argv and sys.path[0], for runs that succeed, fail with a user
error, exit with a status, or raise."""

import os

import pytest
import torch
from conftest import FAST, _server_for, cli_env, losses, run_cli

pytestmark = pytest.mark.slow

SCRIPT = """
import os, sys
print("argv", sys.argv[1:], "path0", sys.path[0] == os.getcwd(), "cwd", os.path.basename(os.getcwd()), "x", os.environ.get("X"))
print("to stderr", file=sys.stderr)
if sys.argv[1] == "raise":
    raise ValueError("boom")
sys.exit(int(sys.argv[1]))
"""


def _forked_then_fresh(monkeypatch, args_of, **kw):
    """`run_cli(args_of(how), **kw)` through the fork server (how="forked"), then in a fresh
    interpreter (how="fresh")."""
    if _server_for(cli_env()) is None:
        # the server forks only from one thread (numpy's BLAS pool is a second one without
        # OMP_NUM_THREADS=1) and not on a GPU
        off = os.environ.get("LOONGFORGE_TEST_FORKSERVER") == "0" or os.environ.get("OMP_NUM_THREADS") != "1"
        assert off or torch.cuda.is_available()
        pytest.skip("the fork server is off here (LOONGFORGE_TEST_FORKSERVER=0, OMP_NUM_THREADS is not 1, or a GPU)")
    forked = run_cli(args_of("forked"), **kw)
    with monkeypatch.context() as m:
        m.setenv("LOONGFORGE_TEST_FORKSERVER", "0")
        assert _server_for(cli_env()) is None
        fresh = run_cli(args_of("fresh"), **kw)
    return forked, fresh


def test_a_module_of_the_working_directory_runs_as_with_python_m(monkeypatch, tmp_path):
    (tmp_path / "probe_mod.py").write_text(SCRIPT)
    for status in ("0", "3", "raise"):
        forked, fresh = _forked_then_fresh(monkeypatch, lambda how: [status, "b c"], module="probe_mod", cwd=tmp_path)
        assert forked.returncode == fresh.returncode == {"0": 0, "3": 3, "raise": 1}[status]
        assert forked.stdout == fresh.stdout == f"argv ['{status}', 'b c'] path0 True cwd {tmp_path.name} x None\n"
        if status == "raise":
            assert fresh.stderr.startswith("to stderr\nTraceback") and fresh.stderr.endswith("ValueError: boom\n")
            assert forked.stderr.startswith("to stderr\nTraceback") and forked.stderr.endswith("ValueError: boom\n")
        else:
            assert forked.stderr == fresh.stderr == "to stderr\n"


def test_a_run_in_another_environment_gets_a_fresh_interpreter(monkeypatch):
    monkeypatch.setenv("X", "1")
    assert _server_for(cli_env()) is None


def test_training_and_a_user_error_are_the_same_forked_and_fresh(monkeypatch, tmp_path):
    args = ["train", "tiny", *FAST, "train.train_iters=3"]
    forked, fresh = _forked_then_fresh(monkeypatch, lambda how: [*args, f"checkpoint.run_dir={tmp_path / how}"])
    for how, r in (("forked", forked), ("fresh", fresh)):
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout.splitlines()[-1] == f"done: step 3, run dir {tmp_path / how}"
    assert losses(tmp_path / "forked") == losses(tmp_path / "fresh") and len(losses(tmp_path / "fresh")) == 3
    forked, fresh = _forked_then_fresh(monkeypatch, lambda how: [*args, f"checkpoint.run_dir={tmp_path / 'bad'}", "train.lrr=1"])
    assert forked.returncode == fresh.returncode == 2
    assert forked.stderr == fresh.stderr and fresh.stderr.startswith("error: unknown config key 'train.lrr'")
    assert not (tmp_path / "bad" / "checkpoints").exists()
