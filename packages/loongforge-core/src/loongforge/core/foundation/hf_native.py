"""A family's HF transformers model, as-is, trained with LoongForge's loss (the torch stack).

The module is the HF `*ForCausalLM` itself (SDPA attention, no KV cache) held as `.hf`; only the
loss is ours: the weighted sum of per-token cross entropies through the op table's
`linear_cross_entropy`, so a fused implementation never materializes the [tokens, vocab] logits.
Weights in and out are the HF model's own state dict, named as HF saves them, so an HF checkpoint
loads without any name mapping and an export is `save_hf(dir, family, cfg, model.hf_state_dict())`.
"""

from __future__ import annotations

import torch
from loongforge.core.errors import UserError
from loongforge.core.foundation.hf_io import hf_config_dict
from loongforge.core.foundation.spec import FamilySpec, ModelConfig
from loongforge.core.ops import OpTable
from torch import nn

PREFIX = "hf."  # where the HF model's tensors sit in this module's own state dict


class HFCausalLMWithLoss(nn.Module):
    def __init__(self, hf: nn.Module, ops: OpTable) -> None:
        super().__init__()
        self.hf = hf
        self.ops = ops

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None, loss_weights: torch.Tensor | None = None) -> torch.Tensor:
        """With `labels`: sum over tokens of loss_weights * CE (fp32 0-d; weights default to ones).
        Without: logits [b, s, vocab]. The output projection runs here rather than in a child
        module's forward, so FSDP's root hooks have gathered lm_head (and tied embeddings)."""
        hidden = self.hf.model(input_ids=tokens).last_hidden_state
        weight = self.hf.lm_head.weight
        if labels is None:
            return hidden @ weight.to(hidden.dtype).T
        if loss_weights is None:
            loss_weights = torch.ones(labels.shape, dtype=torch.float32, device=labels.device)
        return self.ops.linear_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), loss_weights.reshape(-1).float()
        )

    def blocks(self) -> list[nn.Module]:
        """The decoder layers, the unit of FSDP sharding, recompute and compilation."""
        return list(self.hf.model.layers)

    def _hf_names(self) -> tuple[list[str], dict[str, str]]:
        """(the names HF saves, in order; {tied alias: the saved name it shares a tensor with})."""
        saved, aliases, first = [], {}, {}
        for name, t in self.hf.state_dict(keep_vars=True).items():
            key = id(t)
            if key in first:
                aliases[name] = first[key]
            else:
                first[key] = name
                saved.append(name)
        return saved, aliases

    def hf_state_dict(self, state: dict | None = None) -> dict[str, torch.Tensor]:
        """HF-named tensors, one per distinct tensor (a tied lm_head is left out, as HF saves it):
        from `state` (this module's own state dict, e.g. the torch stack's gathered
        `full_state_dict`) or, by default, from the module itself."""
        saved, _ = self._hf_names()
        if state is None:
            own = self.hf.state_dict()
            return {k: own[k] for k in saved}
        return {k: state[PREFIX + k] for k in saved}

    def state_from_hf(self, hf_state: dict) -> dict[str, torch.Tensor]:
        """This module's state dict from HF-named tensors (strict: a missing or unexpected name is
        a UserError); a tied alias may be present or not. For the torch stack's
        `load_full_state_dict` after sharding, or `load_state_dict` before."""
        saved, aliases = self._hf_names()
        missing = [k for k in saved if k not in hf_state]
        unexpected = [k for k in hf_state if k not in aliases and k not in set(saved)]
        if missing:
            raise UserError(f"HF weights lack {missing[0]} ({len(missing)} missing); they do not match this model's config")
        if unexpected:
            raise UserError(
                f"HF weights hold {unexpected[0]}, which this model does not have ({len(unexpected)} unexpected); "
                "check the model config against the checkpoint's config.json"
            )
        out = {PREFIX + k: hf_state[k] for k in saved}
        out.update({PREFIX + alias: hf_state[target] for alias, target in aliases.items()})
        return out

    def load_hf_state_dict(self, hf_state: dict) -> None:
        """Copy HF-named tensors into the (unsharded) model; strict, see `state_from_hf`."""
        self.load_state_dict(self.state_from_hf(hf_state), strict=True)


def build_hf_causal_lm(
    family: FamilySpec, cfg: ModelConfig, ops: OpTable | None = None, params_dtype: torch.dtype = torch.float32
) -> HFCausalLMWithLoss:
    """The family's HF model from `cfg` (randomly initialized as HF does, on the CPU), wrapped
    with our loss. The config goes through the same `hf_config_dict` an export writes, so a
    trained model and its export agree."""
    import transformers

    d = hf_config_dict(family, family.resolve(cfg), params_dtype)
    model_type = d.pop("model_type")
    d.pop("torch_dtype", None)  # transformers 5 reads `dtype`
    hf_cfg = transformers.AutoConfig.for_model(model_type, **d)
    hf_cfg.use_cache = False
    # `dtype` casts the parameters only; HF keeps its rotary frequencies in fp32
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa", dtype=params_dtype)
    return HFCausalLMWithLoss(hf, ops or OpTable())
