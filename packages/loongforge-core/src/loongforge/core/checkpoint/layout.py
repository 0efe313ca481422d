"""Step directories, manifests, checksums and the `latest` pointer."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path

from loongforge.core.errors import UserError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


def fsync_path(path: Path) -> None:
    """Flush a file's or a directory's entries to the disk (a rename is durable only once its
    directory is)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if Path(path).is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file under `root`, then every directory, deepest first, `root` last."""
    root = Path(root)
    dirs = [root]
    for p in sorted(root.rglob("*")):
        if p.is_dir():
            dirs.append(p)
        elif p.is_file():
            fsync_path(p)
    for d in sorted(dirs, key=lambda d: len(d.parts), reverse=True):
        fsync_path(d)


def write_durable(path: Path, content: str | bytes) -> None:
    """Replace `path` with `content` (text or bytes) atomically and durably: a temporary file,
    fsync, rename, fsync of the directory. A crash leaves the old content or the new one, never a
    torn file."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb" if isinstance(content, bytes) else "w") as f:
        f.write(content)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(step_dir: Path) -> list[Path]:
    return sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST)


def read_manifest(step_dir) -> dict:
    path = Path(step_dir) / MANIFEST
    if not path.is_file():
        raise UserError(f"{step_dir}: not a LoongForge checkpoint (no {MANIFEST})")
    try:
        m = json.loads(path.read_text())
    except json.JSONDecodeError:
        raise UserError(f"{path}: corrupt manifest (not valid JSON)") from None
    if m.get("format_version") != FORMAT_VERSION:
        raise UserError(f"{path}: checkpoint format {m.get('format_version')} is not supported (this LoongForge reads {FORMAT_VERSION})")
    return m


def verify_files(step_dir) -> dict:
    """Check every file against the manifest's sha256; name the first one that differs."""
    step_dir = Path(step_dir)
    m = read_manifest(step_dir)
    for rel, digest in m["files"].items():
        p = step_dir / rel
        if not p.is_file():
            raise UserError(f"checkpoint file missing: {p}")
        if sha256_file(p) != digest:
            raise UserError(f"checkpoint file corrupt (sha256 mismatch): {p}")
    return m


def find_checkpoint(path) -> Path | None:
    """A step directory from a step directory, a `checkpoints/` directory or a run directory."""
    p = Path(path)
    if (p / MANIFEST).is_file():
        return p
    for root in (p, p / "checkpoints"):
        latest = root / "latest"
        if latest.is_file():
            step = root / latest.read_text().strip()
            if not (step / MANIFEST).is_file():
                raise UserError(f"{latest} names {step.name}, which is not a complete checkpoint")
            return step
    return None


def checkpoint_manifest(
    run_identity: str | None, config: dict, parallel: dict, trainer_state: dict, rng: dict, trainable_only: bool = False
) -> dict:
    """What a step directory's manifest says besides its files (every writer uses this):
    the run's identity and config, the parallel layout it was saved at, the trainer's counters,
    the RNG states (base64) and whether only trainable tensors are in it. `CheckpointDir.commit`
    adds the format version, step, time and checksums."""
    import torch

    return {
        "run_identity": run_identity,
        "config": config,
        "parallel": parallel,
        "trainer": trainer_state,
        "rng": rng,
        "torch_version": torch.__version__,
        "trainable_only": trainable_only,
    }


class CheckpointDir:
    """The `checkpoints/` directory of a run."""

    def __init__(self, run_dir) -> None:
        self.root = Path(run_dir) / "checkpoints"

    def step_name(self, step: int) -> str:
        return f"step_{step:08d}"

    def latest(self) -> Path | None:
        return find_checkpoint(self.root) if self.root.exists() else None

    def tmp_dir(self, step: int) -> Path:
        """Where step `step` is written before `commit` renames it into place."""
        return self.root / f".tmp-{self.step_name(step)}"

    def begin(self, step: int) -> Path:
        """A fresh temporary directory for step `step` (rank 0 calls this)."""
        tmp = self.tmp_dir(step)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        return tmp

    def commit(self, tmp: Path, step: int, manifest: dict, keep_last: int = 0) -> Path:
        """Make step `step` durable and current, in an order that a crash or power loss at any
        point leaves either the previous state or the new one: every file of `tmp` and the
        manifest with their checksums fsynced, `tmp` renamed into place, the directory fsynced,
        then `latest` replaced the same way. With `keep_last`, older checkpoints of the same run
        (by the manifests' run identity) are pruned; another run's are never touched."""
        manifest = dict(manifest, format_version=FORMAT_VERSION, step=step, saved_at=time.time())
        manifest["files"] = {str(p.relative_to(tmp)): sha256_file(p) for p in _files(tmp)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, default=str))
        fsync_tree(tmp)
        final = self.root / self.step_name(step)
        if final.exists():
            # Replaced only after the new copy is complete (a re-save of the same step).
            old = final.with_name(final.name + ".old")
            final.rename(old)
            tmp.rename(final)
            fsync_path(self.root)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
            fsync_path(self.root)
        write_durable(self.root / "latest", final.name)
        if keep_last > 0:
            mine = [p for p, m in self.complete() if m.get("run_identity") == manifest.get("run_identity") and p != final]
            for p in sorted(mine)[: max(0, len(mine) - (keep_last - 1))]:
                shutil.rmtree(p)
        return final

    def step_dirs(self) -> list[Path]:
        """Every `step_<n>` directory, newest first, complete or not."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if p.is_dir() and re.fullmatch(r"step_\d+", p.name)]
        return sorted(found, key=lambda p: int(p.name[5:]), reverse=True)

    def complete(self) -> list[tuple[Path, dict]]:
        """(step directory, manifest) of every step directory whose manifest reads, newest first
        (the files' checksums are not checked here)."""
        out = []
        for p in self.step_dirs():
            try:
                out.append((p, read_manifest(p)))
            except UserError:
                pass
        return out

    def recover(self) -> list[str]:
        """Undo what a crash inside `commit` or a save can leave (the run directory's owner calls
        this at start, before anything writes): a re-saved step whose old copy was renamed but
        not yet replaced comes back; unfinished `.tmp-step_*` directories go. Returns what was
        done, for the log."""
        done = []
        if not self.root.is_dir():
            return done
        for old in sorted(self.root.glob("step_*.old")):
            target = old.with_name(old.name[: -len(".old")])
            if target.exists():
                shutil.rmtree(old)
            else:
                old.rename(target)
                done.append(f"restored {target.name} from an interrupted re-save")
        for tmp in sorted(self.root.glob(".tmp-step_*")):
            shutil.rmtree(tmp)
            done.append(f"removed the unfinished save {tmp.name}")
        for tmp in self.root.glob("latest.tmp*"):
            tmp.unlink()
        return done
