"""pi0 / pi0.5 weights in LeRobot's layout (`PI0Policy` / `PI05Policy` state dicts, as saved in
their `model.safetensors`), to and from `PiPolicy`'s own names, through one mapping table.

Two LeRobot tensors have no counterpart: PaliGemma's `lm_head.weight` is tied to the token
embedding (exported as that tensor), and the action expert's `lm_head.weight` is never read by
the policy (its decoder takes embeddings only): it is dropped on import and exported as zeros of
its shape, so LeRobot's strict load accepts the file.
"""

from __future__ import annotations

import torch
from loongforge.core.errors import UserError
from loongforge.core.foundation.gemma import GEMMA_TABLE
from loongforge.core.foundation.hf_mapping import Row, hf_to_lf, lf_to_hf, prefixed
from loongforge.core.foundation.siglip import SIGLIP_VISION_TABLE
from loongforge.embodied.policies.pi0 import PiConfig

P = "model.paligemma_with_expert."
BACKBONE_LM_HEAD = P + "paligemma.lm_head.weight"
EXPERT_LM_HEAD = P + "gemma_expert.lm_head.weight"


def _linear(lf: str, hf: str) -> tuple[Row, Row]:
    return Row(lf + ".weight", (hf + ".weight",)), Row(lf + ".bias", (hf + ".bias",))


def lerobot_table(cfg: PiConfig) -> tuple[Row, ...]:
    heads = ("time_mlp_in", "time_mlp_out") if cfg.variant == "pi05" else ("state_proj", "action_time_mlp_in", "action_time_mlp_out")
    rows = [
        *prefixed(SIGLIP_VISION_TABLE, "vision.", P + "paligemma.model.vision_tower.vision_model.", rename={"i": "v"}),
        *_linear("projector", P + "paligemma.model.multi_modal_projector.linear"),
        *prefixed(GEMMA_TABLE, "backbone.", P + "paligemma.model.language_model."),
        *prefixed(GEMMA_TABLE, "expert.", P + "gemma_expert.model."),
    ]
    for name in ("action_in_proj", "action_out_proj", *heads):
        rows += _linear(name, "model." + name)
    return tuple(rows)


class _Shape:
    """What the converters read from a config: the placeholders' counts and the attention shape
    shared by both decoders (`PiConfig.check` enforces that they agree)."""

    def __init__(self, cfg: PiConfig):
        self.num_query_groups = cfg.backbone.num_query_groups
        self.num_attention_heads = cfg.backbone.num_attention_heads
        self.kv_channels = cfg.backbone.head_dim
        self._repeats = {"i": cfg.backbone.num_layers, "v": cfg.vision.num_layers}

    def repeats(self) -> dict[str, int]:
        return self._repeats


def from_lerobot(cfg: PiConfig, state: dict) -> dict[str, torch.Tensor]:
    """`PiPolicy` state dict from a LeRobot policy state dict (keys with or without the leading
    `model.`, as LeRobot itself accepts)."""
    state = {k if k.startswith("model.") else "model." + k: v for k, v in state.items()}
    state = {k: v for k, v in state.items() if k not in (BACKBONE_LM_HEAD, EXPERT_LM_HEAD)}
    try:
        return hf_to_lf(lerobot_table(cfg), state, _Shape(cfg))
    except UserError as e:
        raise UserError(f"LeRobot {cfg.variant} weights: {e}") from None


def to_lerobot(cfg: PiConfig, state: dict) -> dict[str, torch.Tensor]:
    """LeRobot policy state dict (`model.`-prefixed names) from a `PiPolicy` state dict."""
    out = lf_to_hf(lerobot_table(cfg), state, _Shape(cfg))
    embed = state["backbone.embed_tokens.weight"]
    out[BACKBONE_LM_HEAD] = embed.detach().clone()
    out[EXPERT_LM_HEAD] = torch.zeros(cfg.expert.vocab_size, cfg.expert.hidden_size, dtype=embed.dtype)
    return out
