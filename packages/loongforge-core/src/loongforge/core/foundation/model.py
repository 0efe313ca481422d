"""`CausalLM`: a whole (TP=1, PP=1) decoder as a plain module, with HF import/export."""

from __future__ import annotations

import torch
from loongforge.core.errors import UserError
from loongforge.core.foundation import hf_io
from loongforge.core.foundation.hf_mapping import hf_to_lf, lf_to_hf, lora_to_peft
from loongforge.core.foundation.lora import LoRAConfig, is_adapter_key, merged_state
from loongforge.core.foundation.spec import FamilySpec, ModelConfig, build_gpt_model
from torch import nn


def local_state(gpt: nn.Module) -> dict:
    """A megatron model's tensors, without megatron's `_extra_state` placeholders."""
    return {k: v for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}


def load_lf_state(gpt: nn.Module, state: dict) -> None:
    """Copy a TP=1 LoongForge state dict into a TP=1 model, requiring an exact key match (LoRA
    adapters may be absent: base weights carry none)."""
    own = {k: v for k, v in local_state(gpt).items() if k in state or not is_adapter_key(k)}
    missing = sorted(set(own) - set(state))
    extra = sorted(set(state) - set(own))
    if missing or extra:
        raise UserError(f"weights do not fit the model: missing {missing[:3]}, unexpected {extra[:3]}")
    with torch.no_grad():
        for k, t in own.items():
            if t.shape != state[k].shape:
                raise UserError(f"weight {k}: shape {tuple(state[k].shape)} does not fit the model's {tuple(t.shape)}")
            t.copy_(state[k])


class CausalLM(nn.Module):
    """`model(input_ids)` -> logits [batch, seq, vocab]; with `labels`, per-token loss [batch, seq]."""

    def __init__(self, gpt: nn.Module, cfg: ModelConfig, family: FamilySpec, lora: LoRAConfig | None = None):
        super().__init__()
        self.gpt = gpt
        self.cfg = cfg
        self.family = family
        self.lora = lora if lora is not None and lora.enabled else None

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return self.gpt(input_ids, None, None, labels=labels)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | None = None) -> torch.Tensor:
        """Greedy decoding (full recompute per token: a correctness path, not a serving one)."""
        out = input_ids
        for _ in range(max_new_tokens):
            nxt = self(out)[:, -1].argmax(-1, keepdim=True)
            out = torch.cat([out, nxt], dim=1)
            if eos_token_id is not None and bool((nxt == eos_token_id).all()):
                break
        return out

    def hf_state_dict(self) -> dict:
        """HF tensors; LoRA adapters, if any, merged into their base weights."""
        return lf_to_hf(self.family.mapping, merged_state(self.gpt), self.cfg)

    def save_peft(self, out_dir, base_model_name_or_path: str | None = None) -> None:
        """The adapters alone in PEFT's LoRA format (adapter_config.json + adapter_model.safetensors)."""
        if self.lora is None:
            raise UserError("this model has no LoRA adapters to export")
        tensors, modules = lora_to_peft(self.family.mapping, local_state(self.gpt), self.cfg)
        hf_io.save_peft(out_dir, self.lora, tensors, modules, self.cfg.num_layers, base_model_name_or_path)

    def save_hf(self, out_dir, dtype: torch.dtype = torch.float32, extra_config: dict | None = None) -> None:
        hf_io.save_hf(out_dir, self.family, self.cfg, self.hf_state_dict(), dtype, extra_config)

    @classmethod
    def build(cls, family: FamilySpec, cfg: ModelConfig, ctx, ops=None, lora: LoRAConfig | None = None) -> "CausalLM":
        cfg = family.resolve(cfg)
        if ctx.tp_size != 1 or ctx.pp_size != 1:
            raise UserError("CausalLM holds a whole model; build it in a TP=1, PP=1 process")
        return cls(build_gpt_model(cfg, ctx, ops, lora=lora), cfg, family, lora)

    @classmethod
    def from_hf(cls, hf_dir, families: dict, ctx, ops=None) -> "CausalLM":
        family, cfg = hf_io.read_hf_config(hf_dir, families)
        model = cls.build(family, cfg, ctx, ops)
        load_lf_state(model.gpt, hf_to_lf(family.mapping, hf_io.load_hf_state(hf_dir), model.cfg))
        return model
