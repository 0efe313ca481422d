"""Run-directory decisions without training: a run is recognized by its checkpoints' manifests,
damaged checkpoints are skipped (never deleted), `keep_last` prunes only the current run, what a
crash left half done is repaired, and metrics.jsonl keeps one curve."""

import json
import os
from types import SimpleNamespace

import pytest
from loongforge.core.checkpoint import CheckpointDir
from loongforge.core.errors import UserError
from loongforge.core.outputs import clean_stale_temporaries, replaced_dir
from loongforge.core.train.metrics import keep_until
from loongforge.core.train.run_dir import RUN_FILE, prepare_run_dir, start_run_dir

DEAD = 2**22 + 12345  # above Linux's default pid_max: no such process


def _save(run_dir, step, identity, keep_last=0):
    ck = CheckpointDir(run_dir)
    tmp = ck.begin(step)
    (tmp / "weights.bin").write_bytes(bytes([step]) * 64)
    return ck.commit(tmp, step, {"run_identity": identity}, keep_last)


def _cfg(run_dir, resume=False, overwrite=False):
    return SimpleNamespace(run_dir=str(run_dir), resume=resume, overwrite=overwrite)


@pytest.fixture
def run(tmp_path):
    d = tmp_path / "run"
    for step in (1, 2, 3):
        _save(d, step, "mine")
    return d


def test_resumes_the_newest_checkpoint_of_this_run_even_without_latest(run):
    (run / "checkpoints" / "latest").unlink()
    start = prepare_run_dir(_cfg(run), "mine")
    assert start.resume_from.name == "step_00000003" and start.damaged == []
    start_run_dir(_cfg(run), start, "mine")
    assert (run / "checkpoints" / "latest").read_text() == "step_00000003"  # the pointer is repaired
    assert json.loads((run / RUN_FILE).read_text())["run_identity"] == "mine"


@pytest.mark.parametrize("latest", [True, False])
def test_another_runs_checkpoints_are_refused_with_or_without_latest(run, latest):
    if not latest:
        (run / "checkpoints" / "latest").unlink()
    with pytest.raises(UserError, match="holds checkpoints of another run.*checkpoint.resume=true.*checkpoint.overwrite=true"):
        prepare_run_dir(_cfg(run), "other")
    assert prepare_run_dir(_cfg(run, resume=True), "other").resume_from.name == "step_00000003"
    assert prepare_run_dir(_cfg(run, overwrite=True), "other").resume_from is None


@pytest.mark.parametrize("damage", ["flipped byte", "empty manifest", "invalid manifest", "no manifest", "missing file"])
def test_damaged_newest_is_skipped_and_set_aside_not_deleted(run, damage, capsys):
    step3 = run / "checkpoints" / "step_00000003"
    if damage == "flipped byte":
        (step3 / "weights.bin").write_bytes(b"\x00" * 64)
    elif damage == "empty manifest":
        (step3 / "manifest.json").write_bytes(b"")
    elif damage == "invalid manifest":
        (step3 / "manifest.json").write_text('{"format_version": 1, "files"')
    elif damage == "no manifest":
        (step3 / "manifest.json").unlink()
    else:
        (step3 / "weights.bin").unlink()
    start = prepare_run_dir(_cfg(run), "mine")
    assert start.resume_from.name == "step_00000002" and start.damaged == [step3]
    assert "warning: skipping the damaged checkpoint" in capsys.readouterr().out
    start_run_dir(_cfg(run), start, "mine")
    (aside,) = (run / "checkpoints").glob("damaged-step_00000003-*")
    assert not step3.exists() and aside.is_dir()
    assert (run / "checkpoints" / "latest").read_text() == "step_00000002"


def test_no_intact_checkpoint_is_refused_and_overwrite_sets_the_run_aside(run, tmp_path):
    for p in (run / "checkpoints").glob("step_*"):
        (p / "manifest.json").write_text("")
    with pytest.raises(UserError, match="holds no intact checkpoint.*checkpoint.overwrite=true"):
        prepare_run_dir(_cfg(run), "mine")
    start = prepare_run_dir(_cfg(run, overwrite=True), "mine")
    assert start.resume_from is None
    start_run_dir(_cfg(run, overwrite=True), start, "mine")
    (old,) = tmp_path.glob("run.previous-*")
    assert sorted(p.name for p in (old / "checkpoints").glob("step_*")) == ["step_00000001", "step_00000002", "step_00000003"]
    assert [p.name for p in run.iterdir()] == [RUN_FILE]


def test_a_run_without_checkpoints_is_recognized_by_its_run_file(tmp_path):
    d = tmp_path / "run"
    start_run_dir(_cfg(d), prepare_run_dir(_cfg(d), "first"), "first")
    assert prepare_run_dir(_cfg(d), "first").resume_from is None
    with pytest.raises(UserError, match="belongs to another run that saved no checkpoint yet"):
        prepare_run_dir(_cfg(d), "second")


def test_keep_last_prunes_only_this_runs_checkpoints(tmp_path):
    d = tmp_path / "run"
    for step in (1, 2):
        _save(d, step, "other")
    for step in (3, 4, 5):
        _save(d, step, "mine", keep_last=2)
    assert sorted(p.name for p in (d / "checkpoints").glob("step_*")) == [
        "step_00000001",
        "step_00000002",
        "step_00000004",
        "step_00000005",
    ]


def test_commit_leaves_no_temporaries_and_latest_last(tmp_path):
    final = _save(tmp_path, 7, "mine")
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000007"]
    assert json.loads((final / "manifest.json").read_text())["files"].keys() == {"weights.bin"}


def test_recover_restores_an_interrupted_resave_and_drops_unfinished_saves(run, capsys):
    ck = run / "checkpoints"
    (ck / "step_00000003").rename(ck / "step_00000003.old")  # killed between the two renames of a re-save
    (ck / ".tmp-step_00000004").mkdir()
    (ck / f"latest.tmp-{DEAD}").write_text("step_00000004")
    assert prepare_run_dir(_cfg(run), "mine").resume_from.name == "step_00000003"
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step_00000001", "step_00000002", "step_00000003"]
    assert "restored step_00000003" in capsys.readouterr().out


def test_stale_temporaries_of_dead_processes_go_live_ones_stay(tmp_path):
    (tmp_path / f"hf.tmp-{DEAD}").mkdir()
    (tmp_path / f"tokenizer.tmp-{DEAD}").mkdir()
    (tmp_path / f"metrics.jsonl.tmp-{DEAD}").write_text("{}")
    (tmp_path / f"export.old.tmp-{DEAD}").mkdir()  # a replaced copy whose replacement never landed
    (tmp_path / f"hf.tmp-{os.getppid()}").mkdir()  # a live process's
    done = clean_stale_temporaries(tmp_path)
    assert len(done) == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", f"hf.tmp-{os.getppid()}"]


def test_replaced_dir_keeps_the_old_copy_until_the_new_one_is_complete(tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("old")
    with pytest.raises(RuntimeError):
        with replaced_dir(out) as tmp:
            (tmp / "config.json").write_text("half")
            raise RuntimeError("killed")
    assert (out / "config.json").read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    with replaced_dir(out) as tmp:
        (tmp / "config.json").write_text("new")
    assert (out / "config.json").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_metrics_keep_the_resumed_steps_only(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": 1.0 / s} for s in range(1, 6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "lo')  # torn by the kill
    keep_until(path, 3)
    assert [json.loads(ln)["step"] for ln in path.read_text().splitlines()] == [1, 2, 3]
    keep_until(path, 0)
    assert path.read_text() == ""


def test_commit_order_makes_each_step_durable_before_the_next(tmp_path, monkeypatch):
    """Files and manifest fsynced before the step is renamed into place, the directory fsynced
    after the rename, and only then `latest` written, fsynced and renamed (a power loss at any
    point leaves the previous checkpoint or the new one)."""
    from pathlib import Path

    from loongforge.core.checkpoint import layout

    events = []
    real_fsync, real_rename, real_replace = layout.fsync_path, Path.rename, os.replace
    monkeypatch.setattr(layout, "fsync_path", lambda p: (events.append(("fsync", Path(p).name)), real_fsync(p)))
    monkeypatch.setattr(Path, "rename", lambda self, t: (events.append(("rename", self.name, Path(t).name)), real_rename(self, t))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", Path(a).name, Path(b).name)), real_replace(a, b)))
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", "<latest.tmp>")))
    _save(tmp_path, 3, "mine")
    rename = events.index(("rename", ".tmp-step_00000003", "step_00000003"))
    before = {e[1] for e in events[:rename] if e[0] == "fsync"}
    assert {"weights.bin", "manifest.json", ".tmp-step_00000003"} <= before
    assert events[rename + 1] == ("fsync", "checkpoints")
    replace = next(i for i, e in enumerate(events) if e[0] == "replace")
    assert events[replace][2] == "latest" and rename < replace
    assert ("fsync", "<latest.tmp>") in events[rename + 1 : replace]
    assert events[replace + 1] == ("fsync", "checkpoints")
