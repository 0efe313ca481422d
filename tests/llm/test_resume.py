"""kill -9 after a checkpoint, rerun the same command: the same losses as an uninterrupted run.
Resume at another layout; a corrupted shard is named."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import FAST, cli_env, losses, run_cli

pytestmark = pytest.mark.slow
STEPS = 6


def _args(run_dir, hf):
    # Steps of ~0.5 s on a 2-core CPU leave the test time to kill the run between the step-3
    # checkpoint and the next one.
    slow = ["train.micro_batch_size=8", "train.global_batch_size=64", "data.seq_length=128"]
    return [
        "train",
        "tiny",
        *FAST,
        *slow,
        f"train.train_iters={STEPS}",
        "train.save_interval=3",
        f"checkpoint.load={hf}",
        f"checkpoint.run_dir={run_dir}",
    ]


@pytest.fixture(scope="module")
def uninterrupted(hf_llama4, tmp_path_factory):
    d = tmp_path_factory.mktemp("full")
    r = run_cli(_args(d, hf_llama4))
    assert r.returncode == 0, r.stderr[-3000:]
    return d


@pytest.fixture(scope="module")
def killed(hf_llama4, tmp_path_factory):
    """A run killed with SIGKILL right after its step-3 checkpoint landed."""
    d = tmp_path_factory.mktemp("killed")
    # its own process group, so the kill takes its helper processes too (as killing a job does)
    p = subprocess.Popen(
        [sys.executable, "-m", "loongforge.llm.cli", *_args(d, hf_llama4)],
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    latest = d / "checkpoints" / "latest"
    deadline = time.time() + 300
    while not latest.exists() and time.time() < deadline and p.poll() is None:
        time.sleep(0.01)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    assert latest.read_text() == "step_00000003"
    return d


def test_resume_after_kill_matches_uninterrupted(killed, uninterrupted, hf_llama4, tmp_path):
    d = tmp_path / "run"
    shutil.copytree(killed, d)
    r = run_cli(_args(d, hf_llama4))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout
    want, got = losses(uninterrupted), losses(d)
    for step in range(4, STEPS + 1):
        assert abs(got[step] - want[step]) <= 1e-6, (step, got[step], want[step])


@pytest.mark.parametrize("layout", ["parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2"])
def test_resume_at_another_layout(layout, killed, uninterrupted, hf_llama4, tmp_path):
    d = tmp_path / "run"
    shutil.copytree(killed, d)
    r = run_cli(_args(d, hf_llama4) + [layout], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    want, got = losses(uninterrupted), losses(d)
    for step in range(4, STEPS + 1):
        assert abs(got[step] - want[step]) <= 1e-5 * want[step], (layout, step, got[step], want[step])


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_shard_fails_naming_the_file(damage, killed, hf_llama4, tmp_path):
    d = tmp_path / "run"
    shutil.copytree(killed, d)
    shard = sorted((d / "checkpoints" / "step_00000003").glob("*.distcp"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2] if damage == "truncate" else data[:100] + bytes([data[100] ^ 1]) + data[101:])
    before = sorted(p.name for p in (d / "checkpoints").iterdir())
    r = run_cli(_args(d, hf_llama4))
    assert r.returncode == 2, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    # the only checkpoint is damaged: refused, naming the file, nothing moved or deleted
    assert last.startswith("error:") and "holds no intact checkpoint" in last and "checkpoint file corrupt" in last, last
    assert shard.name in last and "checkpoint.overwrite=true" in last, last
    assert sorted(p.name for p in (d / "checkpoints").iterdir()) == before
