"""The step-directory layout: atomic commit, `latest`, checksums."""

import json

import pytest
from loongforge.core.checkpoint import CheckpointDir, find_checkpoint, verify_files
from loongforge.core.errors import UserError


def _save(ck: CheckpointDir, step: int, payload: bytes = b"weights"):
    tmp = ck.begin(step)
    (tmp / "shard.bin").write_bytes(payload)
    return ck.commit(tmp, step, {"config": {}})


def test_commit_and_latest(tmp_path):
    ck = CheckpointDir(tmp_path)
    s1 = _save(ck, 1)
    s2 = _save(ck, 2)
    assert (ck.root / "latest").read_text() == s2.name
    assert find_checkpoint(tmp_path) == s2 and find_checkpoint(s1) == s1
    m = json.loads((s2 / "manifest.json").read_text())
    assert m["step"] == 2 and set(m["files"]) == {"shard.bin"} and len(m["files"]["shard.bin"]) == 64
    assert not list(ck.root.glob(".tmp-*"))


def test_unfinished_save_is_never_latest(tmp_path):
    ck = CheckpointDir(tmp_path)
    good = _save(ck, 1)
    tmp = ck.begin(2)  # a save that crashed before commit
    (tmp / "shard.bin").write_bytes(b"half")
    assert find_checkpoint(tmp_path) == good


def test_corrupt_and_missing_files_are_named(tmp_path):
    ck = CheckpointDir(tmp_path)
    s = _save(ck, 1)
    verify_files(s)
    (s / "shard.bin").write_bytes(b"weightz")
    with pytest.raises(UserError, match=r"corrupt \(sha256 mismatch\): .*shard.bin"):
        verify_files(s)
    (s / "shard.bin").unlink()
    with pytest.raises(UserError, match="missing: .*shard.bin"):
        verify_files(s)


def test_keep_last(tmp_path):
    ck = CheckpointDir(tmp_path)
    for i in range(1, 5):
        tmp = ck.begin(i)
        (tmp / "x").write_text(str(i))
        ck.commit(tmp, i, {}, keep_last=2)
    assert sorted(p.name for p in ck.root.glob("step_*")) == ["step_00000003", "step_00000004"]
