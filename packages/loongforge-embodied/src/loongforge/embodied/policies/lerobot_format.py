"""pi0 / pi0.5 weights in LeRobot's layout (`PI0Policy` / `PI05Policy` state dicts, as saved in
their `model.safetensors`), to and from `PiPolicy`'s own names, through one mapping table.

Two LeRobot tensors have no counterpart: PaliGemma's `lm_head.weight` is tied to the token
embedding (exported as that tensor), and the action expert's `lm_head.weight` is never read by
the policy (its decoder takes embeddings only): it is dropped on import and exported as zeros of
its shape, so LeRobot's strict load accepts the file.

`lerobot_config` is the policy's `config.json` as LeRobot 0.4's `PI0Config` / `PI05Config` read it,
for the shapes those configs can name (their `gemma_2b` / `gemma_300m` variants and PaliGemma's
SigLIP so400m/14); other shapes have no LeRobot config.
"""

from __future__ import annotations

import torch
from loongforge.core.errors import UserError
from loongforge.core.foundation.gemma import GEMMA_TABLE
from loongforge.core.foundation.hf_mapping import Row, hf_to_lf, lf_to_hf, prefixed
from loongforge.core.foundation.siglip import SIGLIP_VISION_TABLE, SiglipVisionConfig
from loongforge.embodied.policies.pi0 import PiConfig

# LeRobot's (and openpi's) Gemma variants: (layers, width, mlp width, heads, kv heads, head dim)
GEMMA_VARIANTS = {"gemma_2b": (18, 2048, 16384, 8, 1, 256), "gemma_300m": (18, 1024, 4096, 8, 1, 256)}
SIGLIP_SO400M = (27, 1152, 4304, 16, 14)  # layers, width, mlp width, heads, patch

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


def _gemma_variant(g) -> str | None:
    shape = (g.num_layers, g.hidden_size, g.ffn_hidden_size, g.num_attention_heads, g.num_query_groups, g.head_dim)
    return next((name for name, v in GEMMA_VARIANTS.items() if v == shape), None)


def _is_so400m(v: SiglipVisionConfig) -> bool:
    return (v.num_layers, v.hidden_size, v.ffn_hidden_size, v.num_attention_heads, v.patch_size) == SIGLIP_SO400M


def lerobot_config(
    cfg: PiConfig, cameras: list[str], state_dim: int, action_dim: int, normalization: dict[str, str], tokenizer_max_length: int
) -> dict | None:
    """LeRobot's `config.json` for this policy (state and action under LeRobot's own keys,
    `observation.state` and `action`), or None where LeRobot's configs cannot name its shape."""
    backbone, expert = _gemma_variant(cfg.backbone), _gemma_variant(cfg.expert)
    if backbone is None or expert is None or not _is_so400m(cfg.vision):
        return None
    size = cfg.vision.image_size
    return {
        "type": cfg.variant,
        "n_obs_steps": 1,
        "input_features": {
            **{c: {"type": "VISUAL", "shape": [3, size, size]} for c in cameras},
            "observation.state": {"type": "STATE", "shape": [state_dim]},
        },
        "output_features": {"action": {"type": "ACTION", "shape": [action_dim]}},
        "normalization_mapping": {"VISUAL": "IDENTITY", "STATE": normalization["state"], "ACTION": normalization["action"]},
        "paligemma_variant": backbone,
        "action_expert_variant": expert,
        "dtype": "float32",
        "chunk_size": cfg.chunk_size,
        "n_action_steps": cfg.chunk_size,
        "max_state_dim": cfg.max_state_dim,
        "max_action_dim": cfg.max_action_dim,
        "num_inference_steps": cfg.num_inference_steps,
        "time_sampling_beta_alpha": cfg.time_beta_alpha,
        "time_sampling_beta_beta": cfg.time_beta_beta,
        "time_sampling_scale": cfg.time_scale,
        "time_sampling_offset": cfg.time_offset,
        "min_period": cfg.min_period,
        "max_period": cfg.max_period,
        "image_resolution": [size, size],
        "tokenizer_max_length": tokenizer_max_length,
    }
