"""Run setup every recipe shares: the run's identity, what its run directory holds (resume,
refuse or start over), the batch-size rules, the stack a config asks for."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import time
from pathlib import Path

from loongforge.core.checkpoint import CheckpointDir, read_manifest
from loongforge.core.errors import UserError
from loongforge.core.parallel import on_rank0

# TrainConfig fields that do not change what a run computes (a resumed run may change them)
NOT_IDENTITY = ("train_iters", "log_interval", "eval_interval", "eval_iters", "save_interval", "max_bad_steps", "recompute")


def fingerprint(run_identity: dict) -> str:
    return hashlib.sha256(json.dumps(run_identity, sort_keys=True, default=str).encode()).hexdigest()[:16]


def run_identity(train_cfg, **sections) -> str:
    """The identity of a run: the train section (less what a resume may change) and the
    recipe's own sections (model, data, starting weights, ...), as dataclasses or plain values."""
    t = dataclasses.asdict(train_cfg)
    for k in NOT_IDENTITY:
        t.pop(k, None)
    parts = {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for k, v in sections.items()}
    return fingerprint({"train": t, **parts})


def weight_source(load) -> tuple[str | None, Path | None]:
    """Where a run's starting weights come from (`checkpoint.load`): ("hf", the HF directory),
    ("lf", the LoongForge step directory) or (None, None) for none."""
    from loongforge.core.checkpoint import find_checkpoint
    from loongforge.core.foundation.hf_io import is_hf_dir

    if not load:
        return None, None
    if is_hf_dir(load):
        return "hf", Path(load)
    step = find_checkpoint(load)
    if step is None:
        raise UserError(f"checkpoint.load={load}: neither an HF model directory nor a LoongForge checkpoint")
    return "lf", step


def prepare_run_dir(ckpt_cfg, identity: str) -> Path | None:
    """Decide what `run_dir` holds before anything is built: the checkpoint to resume, None for a
    fresh start, or a refusal when it holds another run's checkpoints."""
    latest = CheckpointDir(ckpt_cfg.run_dir).latest()
    if latest is None:
        return None
    m = read_manifest(latest)
    if m.get("run_identity") == identity or ckpt_cfg.resume:
        return latest
    if ckpt_cfg.overwrite:
        return None
    raise UserError(
        f"{ckpt_cfg.run_dir} holds checkpoints of another run (newest {latest.name}); "
        "set checkpoint.resume=true to continue from them, checkpoint.overwrite=true to move them aside, or pick a new checkpoint.run_dir"
    )


def move_aside(run_dir: Path) -> Path | None:
    """`overwrite=true`: keep another run's checkpoints under a new name rather than delete them."""
    root = Path(run_dir) / "checkpoints"
    if not root.exists():
        return None
    dest = root.with_name(f"checkpoints.old-{int(time.time())}")
    shutil.move(str(root), str(dest))
    return dest


def start_run_dir(ckpt_cfg, resume_from: Path | None, prepare=None) -> None:
    """On rank 0: move another run's checkpoints aside (overwrite), create the run directory and
    run `prepare(run_dir)` (the recipe's own files, e.g. its tokenizer copy)."""
    run_dir = Path(ckpt_cfg.run_dir)

    def start():
        if resume_from is None and ckpt_cfg.overwrite:
            moved = move_aside(run_dir)
            if moved:
                print(f"moved the previous checkpoints to {moved}", flush=True)
        run_dir.mkdir(parents=True, exist_ok=True)
        if prepare is not None:
            prepare(run_dir)

    on_rank0(start)


def check_batch_sizes(train_cfg, dp_size: int) -> None:
    t = train_cfg
    if t.micro_batch_size < 1:
        raise UserError(f"train.micro_batch_size={t.micro_batch_size} must be at least 1")
    if t.global_batch_size % (t.micro_batch_size * dp_size):
        raise UserError(
            f"train.global_batch_size={t.global_batch_size} must be a multiple of micro_batch_size*data_parallel_size={t.micro_batch_size * dp_size}"
        )
