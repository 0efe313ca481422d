"""The run directory never loses or mixes data: overwrite sets the whole previous run aside, a run
is recognized by its checkpoints' manifests (not by `latest`), a damaged newest checkpoint falls
back to the newest intact one, `keep_last` prunes only the current run, a changed corpus is never
reused, metrics show one curve after a resume, and a kill at every phase of a run leaves a
directory that the rerun completes with the uninterrupted run's losses and files."""

import json
import shutil
import signal
import subprocess
import sys

import pytest
from conftest import FAST, cli_env, losses, run_cli

pytestmark = pytest.mark.slow


def _args(run_dir, *extra):
    return ["train", "tiny", *FAST, "train.train_iters=2", "train.save_interval=1", f"checkpoint.run_dir={run_dir}", *extra]


def _ok(r):
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r


def _one_line_error(r, *needles):
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-3000:]
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    for n in needles:
        assert n in lines[0], (n, lines[0])


def _digest(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _steps(run_dir):
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_"))


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """Two steps, a checkpoint after each."""
    d = tmp_path_factory.mktemp("finished") / "run"
    _ok(run_cli(_args(d)))
    return d


def _copy(finished, tmp_path):
    d = tmp_path / "run"
    shutil.copytree(finished, d)
    return d


def test_overwrite_sets_the_whole_previous_run_aside(finished, tmp_path):
    d = _copy(finished, tmp_path)
    before = _digest(d)
    r = _ok(run_cli(_args(d, "train.lr=1e-2", "checkpoint.overwrite=true")))
    (old,) = list(tmp_path.glob("run.previous-*"))
    assert f"moved the previous run directory to {old}" in r.stdout
    assert _digest(old) == before  # checkpoints, data cache, tokenizer, metrics, TensorBoard: all kept as they were
    assert [json.loads(ln)["step"] for ln in (d / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert _steps(d) == ["step_00000001", "step_00000002"]


@pytest.mark.parametrize("damage", ["flipped shard", "empty manifest (power loss)"])
def test_damaged_newest_checkpoint_falls_back_to_the_newest_intact_one(damage, finished, tmp_path):
    d = _copy(finished, tmp_path)
    step2 = d / "checkpoints" / "step_00000002"
    if damage == "flipped shard":
        shard = sorted(step2.glob("*.distcp"))[0]
        data = bytearray(shard.read_bytes())
        data[100] ^= 1
        shard.write_bytes(bytes(data))
    else:
        (step2 / "manifest.json").write_bytes(b"")
    kept = _digest(step2)
    r = _ok(run_cli(_args(d, "train.train_iters=3")))
    assert "warning: skipping the damaged checkpoint" in r.stdout and "at step 1" in r.stdout
    (aside,) = list((d / "checkpoints").glob("damaged-step_00000002-*"))
    assert _digest(aside) == kept  # set aside, not deleted
    # step 2 trained again from step 1's state: the same loss as the first time
    assert abs(losses(d)[2] - losses(finished)[2]) <= 1e-6
    assert (d / "checkpoints" / "latest").read_text() == "step_00000003"
    assert [json.loads(ln)["step"] for ln in (d / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_changed_corpus_is_preprocessed_again(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"Ada gave the kite to Ben {i} times."}) + "\n" for i in range(40)))
    d = tmp_path / "run"
    _ok(run_cli(_args(d, f"data.corpus=[{corpus}]")))
    corpus.write_text("".join(json.dumps({"text": f"Cleo gave the lamp to Dev, {i} times over."}) + "\n" for i in range(50)))
    _ok(run_cli(_args(d, f"data.corpus=[{corpus}]", "train.train_iters=3")))
    assert len(list((d / "data").glob("corpus-*"))) == 2


# ---- kill -9 at every phase of a run -------------------------------------------------------

KILL_ARGS = ["train.train_iters=4", "train.save_interval=2", "checkpoint.export_hf=true"]

# Each phase: (module, function or Class.method, condition): the training process wraps the
# function so that a call for which the condition (over the call's `args`) is true SIGKILLs the
# process there; a condition may first leave the work half done, as a kill in the middle would.
PHASES = {
    "tokenizer copy": (
        "loongforge.llm.pretrain",
        "copy_tokenizer",
        "(shutil.copy2(sorted(p for p in Path(args[0]).iterdir() if p.is_file())[0], args[1]), True)[1]",
    ),
    "data caching": ("loongforge.llm.data", "preprocess", "(Path(args[2] + '.bin').write_bytes(b'partial'), True)[1]"),
    "step": ("loongforge.core.train.trainer", "Trainer.train_step", "args[0].state['step'] == 2"),
    "checkpoint write": ("loongforge.core.checkpoint.layout", "CheckpointDir.commit", "args[2] == 4"),
    "pointer swap": ("loongforge.core.checkpoint.layout", "write_durable", "Path(args[0]).name == 'latest' and args[1] == 'step_00000004'"),
    "export": ("loongforge.llm.pretrain", "lf_to_hf", "(Path(args[1], 'config.json').write_text('{'), True)[1]"),
}

DRIVER = """
import importlib, os, shutil, signal, sys
from pathlib import Path

module, attr, when = sys.argv[1:4]
owner = importlib.import_module(module)
*path, name = attr.split(".")
for part in path:
    owner = getattr(owner, part)
original = getattr(owner, name)

def wrapper(*args, **kw):
    if eval(when, {"args": args, "Path": Path, "shutil": shutil}):
        os.kill(os.getpid(), signal.SIGKILL)
    return original(*args, **kw)

setattr(owner, name, wrapper)
from loongforge.llm.cli import main
sys.exit(main(sys.argv[4:]))
"""


@pytest.fixture(scope="module")
def uninterrupted_kill_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("uninterrupted") / "run"
    _ok(run_cli(_args(d, *KILL_ARGS)))
    return d


@pytest.mark.parametrize("phase", list(PHASES))
def test_kill_at_each_phase_then_rerun_completes_the_run(phase, uninterrupted_kill_run, tmp_path):
    d = tmp_path / "run"
    where, name, action = PHASES[phase]
    p = subprocess.run(
        [sys.executable, "-c", DRIVER, where, name, action, *_args(d, *KILL_ARGS)],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == -signal.SIGKILL, (phase, p.returncode, p.stderr[-3000:])
    _ok(run_cli(_args(d, *KILL_ARGS)))
    want, got = losses(uninterrupted_kill_run), losses(d)
    assert sorted(got) == [1, 2, 3, 4], got  # one curve: no step logged twice
    for step in want:
        assert abs(got[step] - want[step]) <= 1e-6, (phase, step, got[step], want[step])
    for sub in ("tokenizer", "hf"):
        assert sorted(_digest(d / sub)) == sorted(_digest(uninterrupted_kill_run / sub)), (phase, sub)
    assert _digest(d / "tokenizer") == _digest(uninterrupted_kill_run / "tokenizer")
    assert json.loads((d / "hf" / "config.json").read_text()) == json.loads((uninterrupted_kill_run / "hf" / "config.json").read_text())
    left = [str(p) for p in d.rglob("*") if ".tmp" in p.name]
    assert left == [], (phase, left)
    assert (d / "checkpoints" / "latest").read_text() == "step_00000004"
