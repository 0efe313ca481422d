"""The `embodied.pi` recipe: pi0 / pi0.5 trained on LeRobot datasets with core's trainer on the
torch-native stack (DDP, ZeRO-1, FSDP2, HSDP)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from loongforge.core.accelerator import get_accelerator
from loongforge.core.checkpoint.layout import write_durable
from loongforge.core.data.text import copy_tokenizer, load_tokenizer, resolve_tokenizer_path
from loongforge.core.errors import UserError
from loongforge.core.ops import OpTable
from loongforge.core.outputs import replaced_dir
from loongforge.core.parallel import on_rank0
from loongforge.core.registry import registry
from loongforge.core.stacks.build import build_stack
from loongforge.core.train.precision import resolve_params_dtype
from loongforge.core.train.run_dir import prepare_run_dir, run_identity, start_run_dir
from loongforge.core.train.trainer import Trainer
from loongforge.embodied.data import LeRobotDataset
from loongforge.embodied.data.demo_dataset import write_demo_dataset
from loongforge.embodied.pi_task import PiTask, RobotSamples


def dataset_roots(cfg, run_dir: Path) -> list[Path]:
    """Each dataset's directory; "demo" is the generated demo set under run_dir/data/demo."""
    roots = []
    for d in cfg.data.datasets:
        root = run_dir / "data" / "demo" if d.root == "demo" else Path(d.root)
        if d.root != "demo" and not (root / "meta" / "info.json").is_file():
            raise UserError(f"data.datasets: {root} is not a LeRobot dataset (no meta/info.json)")
        roots.append(root)
    return roots


def validate(cfg) -> None:
    if cfg.parallel.stack != "torch":
        raise UserError(f"parallel.stack={cfg.parallel.stack}: embodied policies train on the torch stack; set parallel.stack=torch")
    if not cfg.data.datasets:
        raise UserError("data.datasets is empty: name at least one LeRobot dataset (or root: demo)")
    load = cfg.checkpoint.load
    if load and not (Path(load) / "model.safetensors").is_file():
        raise UserError(f"checkpoint.load={load}: expected a LeRobot pi0 / pi0.5 directory with model.safetensors")
    cfg.policy.resolved().check()
    parts = ("vision", "projector", "backbone", "expert")
    unknown = [p for p in cfg.freeze if p not in parts]
    if unknown:
        raise UserError(f"freeze: unknown part {unknown[0]!r} (parts: {', '.join(parts)})")
    cfg.lora.validate()
    if cfg.lora.enabled:  # a target that matches nothing is refused before anything is written
        from loongforge.core.foundation.lora import add_adapters
        from loongforge.embodied.policies import PiPolicy

        with torch.device("meta"):
            add_adapters(PiPolicy(cfg.policy.resolved()), cfg.lora)
    if set(parts) <= set(cfg.freeze):
        raise UserError("freeze names every part with a decoder; the action projections alone would train: drop one part from freeze")


def run(cfg) -> dict:
    validate(cfg)
    cfg = dataclasses.replace(cfg, policy=cfg.policy.resolved())
    acc = get_accelerator()
    params_dtype = resolve_params_dtype(cfg.train.params_dtype, acc)
    stack, _ = build_stack(cfg.parallel, cfg.train, acc, params_dtype)
    ops = OpTable.build(cfg.ops, registry(), acc.device_type)
    run_dir = Path(cfg.checkpoint.run_dir)
    identity = run_identity(cfg.train, policy=cfg.policy, data=cfg.data, load=cfg.checkpoint.load, freeze=cfg.freeze, lora=cfg.lora)
    start = prepare_run_dir(cfg.checkpoint, identity)
    roots = dataset_roots(cfg, run_dir)
    tok = load_tokenizer(cfg.data.tokenizer)

    def prepare(run_dir: Path):
        for d, root in zip(cfg.data.datasets, roots):
            if d.root == "demo":
                write_demo_dataset(root, image_size=cfg.policy.vision.image_size)
        # serving reads the tokenizer from the run; a resume keeps the run's own copy
        if start.resume_from is None or not (run_dir / "tokenizer").is_dir():
            with replaced_dir(run_dir / "tokenizer") as tmp:
                copy_tokenizer(resolve_tokenizer_path(cfg.data.tokenizer), tmp)

    start_run_dir(cfg.checkpoint, start, identity, prepare)
    samples = RobotSamples([LeRobotDataset(r) for r in roots], [d.weight for d in cfg.data.datasets], cfg.policy, cfg.data, tok)
    if len(tok) > cfg.policy.backbone.vocab_size:
        raise UserError(f"tokenizer has {len(tok)} tokens but policy.backbone.vocab_size is {cfg.policy.backbone.vocab_size}")

    def save_normalizers():
        # what serving needs to map observations in and actions out, without the datasets
        stats = {str(r): n.state_dict() for r, n in zip(roots, samples.normalizers)}
        write_durable(run_dir / "normalizer.json", json.dumps(stats, indent=1))
        io = {"cameras": samples.cameras, "state_dim": samples.state_dim, "action_dim": samples.action_dim}
        write_durable(run_dir / "policy_io.json", json.dumps(io, indent=1))

    on_rank0(save_normalizers)
    load = Path(cfg.checkpoint.load) if cfg.checkpoint.load else None
    task = PiTask(cfg, samples, stack.dp_rank, stack.dp_size, acc.device(), ops, load)
    trainer = Trainer(cfg.train, cfg.checkpoint, stack, acc, task, dataclasses.asdict(cfg), identity, ops)
    return trainer.run(start.resume_from, verified=True)
