"""HF <-> LoongForge checkpoint conversion and `load_model`, all through core's family tables."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import torch
from loongforge.core.checkpoint import (
    CheckpointDir,
    checkpoint_manifest,
    find_checkpoint,
    load_megatron,
    save_megatron,
    verify_files,
)
from loongforge.core.data.text import copy_tokenizer, tokenizer_dir_for
from loongforge.core.errors import UserError
from loongforge.core.foundation import hf_io
from loongforge.core.foundation.hf_mapping import hf_to_lf as hf_to_lf_state
from loongforge.core.foundation.lora import is_adapter_key, lora_from_manifest
from loongforge.core.foundation.model import CausalLM, load_lf_state
from loongforge.core.foundation.spec import ModelConfig
from loongforge.core.outputs import require_new_dir
from loongforge.core.parallel import single_process_context
from loongforge.core.registry import registry


def families() -> dict:
    reg = registry()
    return {n: reg.get("family", n) for n in reg.names("family")}


def model_config_from_manifest(manifest: dict) -> ModelConfig:
    return ModelConfig(**manifest["config"]["model"])


def load_model(path, base=None) -> CausalLM:
    """An HF directory or a LoongForge checkpoint (run dir, checkpoints dir or step dir) as a
    CPU fp32 `CausalLM` in eval mode: `model(input_ids)` -> logits [batch, seq, vocab].

    A LoRA checkpoint holds only adapters: its base weights come from `base`, by default the
    `checkpoint.load` it was trained from."""
    ctx = single_process_context()
    if hf_io.is_hf_dir(path):
        return CausalLM.from_hf(path, families(), ctx).eval()
    step = find_checkpoint(path)
    if step is None:
        raise UserError(f"{path}: neither an HF model directory nor a LoongForge checkpoint")
    m = verify_files(step)
    cfg = model_config_from_manifest(m)
    lora = lora_from_manifest(m)
    model = CausalLM.build(registry().get("family", cfg.family), cfg, ctx, lora=lora)
    if checkpoint_stack(m) == "torch":  # DCP shards of the HF model: read whole, mapped by the family's table
        from loongforge.core.checkpoint.dcp_io import read_model_state
        from loongforge.core.foundation.hf_native import PREFIX

        hf_state = {k.removeprefix(PREFIX): v for k, v in read_model_state(step).items()}
        load_lf_state(model.gpt, hf_to_lf_state(model.family.mapping, hf_state, model.cfg))
        return model.eval()
    if lora is None:
        load_megatron(step, model.gpt)
        return model.eval()
    base = base or m["config"]["checkpoint"]["load"]
    if not base or not Path(base).exists():
        raise UserError(f"{step} holds LoRA adapters only; its base model {base!r} is not there: pass --base /path/to/base")
    if hf_io.is_hf_dir(base):
        load_lf_state(model.gpt, hf_to_lf_state(model.family.mapping, hf_io.load_hf_state(base), model.cfg))
    else:
        base_step = find_checkpoint(base)
        if base_step is None:
            raise UserError(f"base model {base}: neither an HF model directory nor a LoongForge checkpoint")
        verify_files(base_step)
        load_megatron(base_step, model.gpt, select=lambda k: not is_adapter_key(k))
    load_megatron(step, model.gpt, select=is_adapter_key)
    return model.eval()


def write_checkpoint(model: CausalLM, out_dir, extra_config: dict | None = None) -> Path:
    """Save a whole model as a step-0 LoongForge checkpoint (megatron stack, TP=1) under `out_dir`."""
    ckdir = CheckpointDir(require_new_dir(out_dir))
    tmp = ckdir.begin(0)
    save_megatron(tmp, model.gpt)
    layout = {"stack": "megatron", "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "data_parallel_size": 1}
    state = {"step": 0, "optimizer_steps": 0, "consumed_samples": 0, "bad_steps": 0}
    manifest = checkpoint_manifest(None, {"model": dataclasses.asdict(model.cfg), **(extra_config or {})}, layout, state, {})
    return ckdir.commit(tmp, 0, manifest)


def checkpoint_stack(manifest: dict) -> str:
    """The stack that wrote a checkpoint (its shard format): megatron or torch."""
    return manifest.get("parallel", {}).get("stack", "megatron")


def hf_to_lf(hf_dir, out_dir) -> Path:
    require_new_dir(out_dir)
    model = CausalLM.from_hf(hf_dir, families(), single_process_context())
    tok = tokenizer_dir_for(hf_dir)
    step = write_checkpoint(model, out_dir)
    if tok is not None:
        (Path(out_dir) / "tokenizer").mkdir(exist_ok=True)
        copy_tokenizer(tok, Path(out_dir) / "tokenizer")
    return step


def lf_to_hf(ckpt, out_dir, dtype: torch.dtype = torch.float32, base=None) -> Path:
    """An HF model directory from a checkpoint (LoRA adapters merged into the base weights)."""
    step = _existing_step(ckpt)
    out = require_new_dir(out_dir)
    model = load_model(step, base)
    tok_dir = tokenizer_dir_for(step)
    extra = {}
    if tok_dir is not None:
        from loongforge.core.data.text import load_tokenizer

        tok = load_tokenizer(str(tok_dir))
        extra = {"eos_token_id": tok.eos_token_id, "bos_token_id": tok.bos_token_id, "pad_token_id": tok.pad_token_id}
    model.save_hf(out, dtype=dtype, extra_config=extra)
    if tok_dir is not None:
        copy_tokenizer(tok_dir, out)
    return out


def lf_to_peft(ckpt, out_dir, base=None) -> Path:
    """A LoRA checkpoint's adapters as a PEFT adapter directory (with the tokenizer); `base` (the
    base model, by default the run's checkpoint.load) is loaded and recorded as the adapter's base."""
    return hf_io.export_peft(
        ckpt, out_dir, lambda step, out, recorded: load_model(step, base).save_peft(out, recorded), base, "use lf-to-hf"
    )


def _existing_step(ckpt) -> Path:
    step = find_checkpoint(ckpt)
    if step is None:
        raise UserError(f"{ckpt}: not a LoongForge checkpoint (no manifest.json or latest)")
    return step


def run_converter_subprocess(direction: str, src, dst) -> None:
    """Run a conversion in a fresh single process (a TP/PP>1 process cannot hold a whole model)."""
    launcher = (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_NAME",
        "ROLE_WORLD_SIZE",
    )
    env = {k: v for k, v in os.environ.items() if k not in launcher and not k.startswith("TORCHELASTIC_")}
    env["LOONGFORGE_DEVICE"] = "cpu"
    r = subprocess.run(
        [sys.executable, "-m", "loongforge.llm.cli", "convert", direction, str(src), str(dst)], env=env, capture_output=True, text=True
    )
    if r.returncode != 0:
        raise UserError(f"conversion {direction} {src} -> {dst} failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
