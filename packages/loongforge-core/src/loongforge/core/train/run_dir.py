"""Run setup every recipe shares: the run's identity, what its run directory holds (resume,
refuse or start over), the batch-size rules, the stack a config asks for."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path

from loongforge.core.checkpoint import CheckpointDir, read_manifest, verify_files
from loongforge.core.checkpoint.layout import write_durable
from loongforge.core.errors import UserError
from loongforge.core.outputs import clean_stale_temporaries
from loongforge.core.parallel import on_rank0

# TrainConfig fields that do not change what a run computes (a resumed run may change them)
NOT_IDENTITY = ("train_iters", "log_interval", "eval_interval", "eval_iters", "save_interval", "max_bad_steps", "recompute")


def fingerprint(run_identity: dict) -> str:
    return hashlib.sha256(json.dumps(run_identity, sort_keys=True, default=str).encode()).hexdigest()[:16]


def files_identity(paths) -> list:
    """[resolved path, size, modification time in ns] of each file (None, None where it is
    missing): what a cache built from the files is keyed by."""
    out = []
    for p in map(Path, paths):
        st = p.stat() if p.exists() else None
        out.append([str(p.resolve()), st and st.st_size, st and st.st_mtime_ns])
    return out


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


RUN_FILE = "run.json"  # the run's identity, written at start: recognizes a run before its first checkpoint


@dataclasses.dataclass
class RunStart:
    """What `prepare_run_dir` decided: the checkpoint to resume (checked against its manifest's
    checksums; None: a fresh start) and the damaged checkpoints newer than it, which
    `start_run_dir` sets aside."""

    resume_from: Path | None = None
    damaged: list = dataclasses.field(default_factory=list)


def prepare_run_dir(ckpt_cfg, identity: str) -> RunStart:
    """Decide what `run_dir` holds before anything is built. A run is recognized by the run
    identity in its checkpoints' manifests (before its first checkpoint: by its run.json), never
    by `latest` alone. This run's newest intact checkpoint is resumed; newer damaged ones (an
    unreadable manifest, a file that fails its checksum) are skipped with a warning. Another
    run's checkpoints are refused unless `checkpoint.resume` (continue from them) or
    `checkpoint.overwrite` (set the whole previous run directory aside, as for a damaged run with
    nothing intact). What a crash left half done (an interrupted re-save, unfinished
    temporaries) is repaired first."""
    return on_rank0(lambda: _decide(ckpt_cfg, identity))


def _decide(ckpt_cfg, identity: str) -> RunStart:
    run_dir = Path(ckpt_cfg.run_dir)
    ck = CheckpointDir(run_dir)
    for line in ck.recover() + clean_stale_temporaries(run_dir) + clean_stale_temporaries(run_dir / "data"):
        print(f"{run_dir}: {line}", flush=True)
    damaged: list[tuple[Path, str]] = []
    for step in ck.step_dirs():
        try:
            m = read_manifest(step)
        except UserError as e:
            damaged.append((step, str(e)))
            continue
        if m.get("run_identity") != identity and not ckpt_cfg.resume:
            if ckpt_cfg.overwrite:
                return RunStart()
            raise UserError(
                f"{run_dir} holds checkpoints of another run (newest {step.name}); set checkpoint.resume=true to continue "
                "from them, checkpoint.overwrite=true to set that run aside and start fresh, or pick a new checkpoint.run_dir"
            )
        try:
            verify_files(step)
        except UserError as e:
            damaged.append((step, str(e)))
            continue
        for p, why in damaged:
            print(f"warning: skipping the damaged checkpoint {p} ({why}); resuming from {step.name}", flush=True)
        return RunStart(step, [p for p, _ in damaged])
    if damaged:
        if ckpt_cfg.overwrite:
            return RunStart()
        listing = "; ".join(f"{p.name}: {why}" for p, why in damaged)
        raise UserError(
            f"{run_dir} holds no intact checkpoint ({listing}); set checkpoint.overwrite=true to set the damaged run aside "
            "and start fresh, or pick a new checkpoint.run_dir"
        )
    owner = _run_file_identity(run_dir)
    if owner not in (None, identity) and not (ckpt_cfg.resume or ckpt_cfg.overwrite):
        raise UserError(
            f"{run_dir} belongs to another run that saved no checkpoint yet (its {RUN_FILE}); set checkpoint.overwrite=true "
            "to set it aside and start fresh, or pick a new checkpoint.run_dir"
        )
    return RunStart()


def _run_file_identity(run_dir: Path) -> str | None:
    try:
        return json.loads((run_dir / RUN_FILE).read_text()).get("run_identity")
    except (OSError, ValueError, AttributeError):
        return None


def set_aside(path: Path, name: str) -> Path:
    """Rename `path` to `name` in its directory (with a counter if that is taken): kept, out of
    the way."""
    dest = path.with_name(name)
    n = 1
    while dest.exists():
        n += 1
        dest = path.with_name(f"{name}-{n}")
    path.rename(dest)
    return dest


def start_run_dir(ckpt_cfg, start: RunStart, identity: str, prepare=None) -> None:
    """On rank 0, once the run's config is validated: with `checkpoint.overwrite` and nothing to
    resume, set the whole previous run directory aside (checkpoints, data cache, tokenizer,
    metrics, TensorBoard, exports) under `<run_dir>.previous-<time>`; set damaged checkpoints
    aside; record the run's identity in run.json; run `prepare(run_dir)` (the recipe's own
    files, e.g. its tokenizer copy)."""
    run_dir = Path(ckpt_cfg.run_dir)

    def go():
        if start.resume_from is None and ckpt_cfg.overwrite and run_dir.is_dir() and any(run_dir.iterdir()):
            if Path.cwd().resolve().is_relative_to(run_dir.resolve()):
                raise UserError(f"checkpoint.overwrite=true would move {run_dir}, which holds the current directory; run from elsewhere")
            moved = set_aside(run_dir, f"{run_dir.name}.previous-{time.strftime('%Y%m%d-%H%M%S')}")
            print(f"checkpoint.overwrite: moved the previous run directory to {moved}", flush=True)
        run_dir.mkdir(parents=True, exist_ok=True)
        for p in start.damaged:
            moved = set_aside(p, f"damaged-{p.name}-{time.strftime('%Y%m%d-%H%M%S')}")
            print(f"set the damaged checkpoint {p.name} aside as {moved}", flush=True)
        latest = CheckpointDir(run_dir).root / "latest"
        if start.resume_from is not None and (not latest.is_file() or latest.read_text().strip() != start.resume_from.name):
            write_durable(latest, start.resume_from.name)  # lost, dangling or behind (a kill before the pointer swap)
        write_durable(run_dir / RUN_FILE, json.dumps({"run_identity": identity, "started_at": time.time()}) + "\n")
        if prepare is not None:
            prepare(run_dir)

    on_rank0(go)


def check_batch_sizes(train_cfg, dp_size: int) -> None:
    t = train_cfg
    if t.micro_batch_size < 1:
        raise UserError(f"train.micro_batch_size={t.micro_batch_size} must be at least 1")
    if t.global_batch_size % (t.micro_batch_size * dp_size):
        raise UserError(
            f"train.global_batch_size={t.global_batch_size} must be a multiple of micro_batch_size*data_parallel_size={t.micro_batch_size * dp_size}"
        )
