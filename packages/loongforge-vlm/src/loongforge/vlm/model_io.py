"""`load_model`, HF export (merged) and PEFT export (LoRA adapters) of VLM checkpoints, through
the composed model's mapping table."""

from __future__ import annotations

from pathlib import Path

import torch
from loongforge.core.checkpoint import find_checkpoint, load_megatron, verify_files
from loongforge.core.data.text import copy_tokenizer, tokenizer_dir_for
from loongforge.core.errors import UserError
from loongforge.core.foundation import hf_io
from loongforge.core.foundation.hf_mapping import hf_to_lf, lf_to_hf, lora_to_peft
from loongforge.core.foundation.lora import is_adapter_key, lora_from_manifest
from loongforge.core.parallel import single_process_context
from loongforge.core.registry import registry
from loongforge.vlm.model import VisionLanguageModel, hf_config, hf_state_table, vlm_arch, vlm_config_from_dict, vlm_table


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
    manifest = _vlm_manifest(step)
    config = manifest["config"]
    if lora_from_manifest(manifest) is None:
        cfg = vlm_config_from_dict(config["model"])
        model = VisionLanguageModel.build(registry().get("family", cfg.language.family), cfg, ctx)
        load_megatron(step, model)
        return model.eval()
    model, _ = _lora_run(step, manifest, with_base=True)
    return model


def _vlm_manifest(step: Path) -> dict:
    """A checkpoint's manifest (its files verified), a UserError if it is not a VLM's."""
    manifest = verify_files(step)
    if "vision" not in manifest["config"].get("model", {}):
        raise UserError(f"{step} is not a VLM checkpoint (its model has no vision tower); load it with its own package")
    return manifest


def _lora_run(step: Path, manifest: dict, with_base: bool) -> tuple[VisionLanguageModel, set]:
    """A LoRA run's model (eval) and the names of what it trained. Its checkpoints hold what it
    trained (adapters, unfrozen vision parts); `with_base`: the rest comes from the base it started
    from (else it keeps its initial values)."""
    from loongforge.vlm.config import FreezeConfig, LRMultConfig
    from loongforge.vlm.recipe import freeze

    config = manifest["config"]
    cfg = vlm_config_from_dict(config["model"])
    family = registry().get("family", cfg.language.family)
    model = VisionLanguageModel.build(family, cfg, single_process_context(), lora=lora_from_manifest(manifest))
    freeze(model, FreezeConfig(**config.get("freeze", {})), LRMultConfig())
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    if with_base:
        base = config["checkpoint"].get("load")
        if not base or not Path(base).exists():
            raise UserError(f"{step} holds LoRA adapters; its base model {base!r} is not there")
        if hf_io.is_hf_dir(base):
            hf = hf_io.load_hf_state(base)
            model.load_lf(hf_to_lf(hf_state_table(family, cfg.arch, hf), hf, model.cfg))
        else:
            base_step = find_checkpoint(base)
            if base_step is None:
                raise UserError(f"base model {base}: neither an HF model directory nor a LoongForge checkpoint")
            verify_files(base_step)
            load_megatron(base_step, model, select=lambda k: not is_adapter_key(k))
    load_megatron(step, model, select=trained.__contains__)
    return model.eval(), trained


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


def lf_to_peft(ckpt, out_dir, base=None) -> Path:
    """A LoRA run's adapters as a PEFT adapter directory (adapter_config.json,
    adapter_model.safetensors, the run's tokenizer) for the arch's transformers class:
    `peft.PeftModel.from_pretrained(Qwen2_5_VLForConditionalGeneration.from_pretrained(base), out)`.
    The adapters target the language model's linears by their transformers paths; the vision parts
    the run trained whole (those `freeze.*` left on) go in as PEFT `modules_to_save`. `base` is
    recorded as the base model (default: the run's checkpoint.load); the base weights are not read."""
    return hf_io.export_peft(ckpt, out_dir, _save_peft, base, "convert without --peft for the merged HF model")


def _save_peft(step: Path, out: Path, base_model_name_or_path: str | None) -> None:
    import re

    manifest = _vlm_manifest(step)
    model, trained = _lora_run(step, manifest, with_base=False)
    arch = vlm_arch(model.cfg.arch)
    if model.family.name != arch.family:
        raise UserError(
            f"PEFT export targets {arch.hf_architecture}, whose language model is {arch.family}; this model's is {model.family.name}"
        )
    table = vlm_table(model.family, model.cfg.arch)
    state = model.lf_state()
    # PEFT names modules by their paths in the transformers model, which may differ from the
    # checkpoint names the table gives (Qwen2.5-VL's `model.layers.` are `model.language_model.layers.`)
    paths = hf_io.transformers_names(hf_config(model.cfg, model.family))
    tensors, modules = lora_to_peft(table, state, model.cfg, module_name=lambda n: paths[n + ".weight"].removesuffix(".weight"))
    # the parts the run trained whole (vision tower, merger) go in as PEFT's modules_to_save
    whole = lf_to_hf(table, {k: v for k, v in state.items() if k in trained and not is_adapter_key(k)}, model.cfg, partial=True)
    whole = {paths[k]: v for k, v in whole.items()}
    tensors.update({f"base_model.model.{k}": v for k, v in whole.items()})
    (layers,) = {re.match(r"(.*?\.)\d+\.", m).group(1) for m in modules}  # e.g. model.language_model.layers.
    hf_io.save_peft(
        out,
        lora_from_manifest(manifest),
        tensors,
        modules,
        model.cfg.language.num_layers,
        base_model_name_or_path,
        layers_prefix=layers,
        short_names=False,  # Qwen2.5-VL's vision blocks have gate_proj, up_proj and down_proj too
        modules_to_save=hf_io.peft_modules_to_save(whole, paths.values()),
    )
