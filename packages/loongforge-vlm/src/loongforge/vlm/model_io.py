"""`load_model` and HF export of VLM checkpoints, through the composed model's mapping table."""

from __future__ import annotations

from pathlib import Path

import torch
from loongforge.core.checkpoint import find_checkpoint, load_megatron, verify_files
from loongforge.core.data.text import copy_tokenizer, tokenizer_dir_for
from loongforge.core.errors import UserError
from loongforge.core.foundation import hf_io
from loongforge.core.foundation.hf_mapping import hf_to_lf
from loongforge.core.foundation.lora import LoRAConfig, is_adapter_key
from loongforge.core.parallel import single_process_context
from loongforge.core.registry import registry
from loongforge.vlm.model import VisionLanguageModel, vlm_config_from_dict, vlm_table


def families() -> dict:
    return {n: registry().get("family", n) for n in registry().names("family")}


def load_model(path) -> VisionLanguageModel:
    """An HF Qwen2.5-VL directory or a LoongForge VLM checkpoint (run dir, checkpoints dir or step
    dir) as a CPU fp32 model in eval mode. `model.hf_logits(**processor_outputs)` -> logits
    [batch, seq, vocab]; `model.generate(input_ids, n, pixel_values=..., image_grid_thw=...)`."""
    ctx = single_process_context()
    if hf_io.is_hf_dir(path):
        return VisionLanguageModel.from_hf(path, families(), ctx).eval()
    step = find_checkpoint(path)
    if step is None:
        raise UserError(f"{path}: neither an HF model directory nor a LoongForge checkpoint")
    m = verify_files(step)
    config = m["config"]
    if "vision" not in config.get("model", {}):
        raise UserError(f"{step} is not a VLM checkpoint (its model has no vision tower); load it with its own package")
    cfg = vlm_config_from_dict(config["model"])
    family = registry().get("family", cfg.language.family)
    lora = LoRAConfig(**config.get("lora", {}))
    if not lora.enabled:
        model = VisionLanguageModel.build(family, cfg, ctx)
        load_megatron(step, model)
        return model.eval()
    # a LoRA run's checkpoints hold what it trained (adapters, unfrozen vision parts); the rest
    # comes from the base it started from
    from loongforge.vlm.config import FreezeConfig, LRMultConfig
    from loongforge.vlm.recipe import freeze

    model = VisionLanguageModel.build(family, cfg, ctx, lora=lora)
    freeze(model, FreezeConfig(**config.get("freeze", {})), LRMultConfig())
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    base = config["checkpoint"].get("load")
    if not base or not Path(base).exists():
        raise UserError(f"{step} holds LoRA adapters; its base model {base!r} is not there")
    if hf_io.is_hf_dir(base):
        model.load_lf(hf_to_lf(vlm_table(family, cfg.arch), hf_io.load_hf_state(base), model.cfg))
    else:
        base_step = find_checkpoint(base)
        if base_step is None:
            raise UserError(f"base model {base}: neither an HF model directory nor a LoongForge checkpoint")
        verify_files(base_step)
        load_megatron(base_step, model, select=lambda k: not is_adapter_key(k))
    load_megatron(step, model, select=trained.__contains__)
    return model.eval()


def export_hf(ckpt, out_dir, dtype: torch.dtype = torch.float32) -> Path:
    """An HF Qwen2.5-VL directory (config, safetensors, the run's tokenizer) from a checkpoint."""
    step = find_checkpoint(ckpt)
    if step is None:
        raise UserError(f"{ckpt}: not a LoongForge checkpoint (no manifest.json or latest)")
    model = load_model(step)
    model.save_hf(out_dir, dtype)
    tok = tokenizer_dir_for(step)
    if tok is not None:
        copy_tokenizer(tok, Path(out_dir))
    return Path(out_dir)
