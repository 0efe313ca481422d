"""Step directories, manifests, checksums and the `latest` pointer."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from loongforge.core.errors import UserError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


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
        """Write the manifest with checksums, rename into place, then move `latest`."""
        manifest = dict(manifest, format_version=FORMAT_VERSION, step=step, saved_at=time.time())
        manifest["files"] = {str(p.relative_to(tmp)): sha256_file(p) for p in _files(tmp)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, default=str))
        final = self.root / self.step_name(step)
        if final.exists():
            # Replaced only after the new copy is complete (a re-save of the same step).
            old = final.with_name(final.name + ".old")
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
        pointer = self.root / "latest.tmp"
        pointer.write_text(final.name)
        os.replace(pointer, self.root / "latest")
        if keep_last > 0:
            steps = sorted(p for p in self.root.glob("step_*") if p.is_dir() and p != final)
            for p in steps[: max(0, len(steps) - (keep_last - 1))]:
                shutil.rmtree(p)
        return final
