"""Gemma (v1) decoder as a plain torch module, with its HF mapping table and adaptive RMSNorm.

Gemma's own choices, as HF `GemmaForCausalLM` has them: token embeddings scaled by
sqrt(hidden_size) and tied to the output projection, RMSNorm with a (1 + weight) scale applied in
fp32, a GELU-tanh gated MLP, multi-query / grouped-query attention with `head_dim` independent of
the width, RoPE in the half-split layout.

With `adarms_cond_dim` set, each norm is the adaptive RMSNorm of the pi0.5 action expert: a
zero-initialized linear maps a conditioning vector (the flow-matching time) to a scale, a shift
and a gate; the norm returns `rms(x) * (1 + scale) + shift` and the residual it feeds adds
`gate * y` instead of `y`. Every layer exposes its two halves (`phase="inputs"` / `"finish"`) so
a policy can run several decoders through one joint attention (the pi0 "mixture of transformers").

Fused weights: q/k/v are one linear in megatron's grouped layout ([q_1..q_r | k | v] per query
group) and gate/up one linear [gate | up]; `GEMMA_TABLE` maps both to HF's separate tensors of a
`GemmaModel` (the decoder inside PaliGemma), `GEMMA_CAUSAL_LM_TABLE` to `GemmaForCausalLM`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from loongforge.core.errors import UserError
from loongforge.core.foundation.hf_mapping import Row, prefixed
from loongforge.core.ops import OpTable
from loongforge.core.ops.reference import rms_normalized, rope_inv_freq
from torch import nn

# Added to the scores of masked pairs: finite, so a query with no visible key (a padded token)
# gets a uniform average instead of NaN, with headroom below zero so that adding it to a negative
# score cannot overflow to -inf (the value openpi and LeRobot use).
MASK_VALUE = -2.3819763e38


@dataclass
class GemmaConfig:
    """Shape of a Gemma decoder; field names as in core's `ModelConfig`."""

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int = 1
    head_dim: int = 16
    ffn_hidden_size: int = 128
    vocab_size: int = 256
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    adarms_cond_dim: Optional[int] = None  # set: adaptive RMSNorm conditioned on a vector this wide

    tie_word_embeddings = True  # Gemma always ties; read by the mapping's converters

    @property
    def kv_channels(self) -> int:
        return self.head_dim

    def repeats(self) -> dict[str, int]:
        return {"i": self.num_layers}

    def check(self) -> None:
        if self.num_attention_heads % self.num_query_groups:
            raise UserError(
                f"gemma: num_attention_heads={self.num_attention_heads} must be a multiple of num_query_groups={self.num_query_groups}"
            )

    def hf_config(self) -> dict:
        """The HF `GemmaConfig` fields of this shape (adaRMS has no HF field: plain HF Gemma lacks it)."""
        return {
            "num_hidden_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_query_groups,
            "head_dim": self.head_dim,
            "intermediate_size": self.ffn_hidden_size,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_activation": "gelu_pytorch_tanh",
            "attention_bias": False,
            "tie_word_embeddings": True,
        }

    @classmethod
    def from_hf(cls, d: dict) -> "GemmaConfig":
        act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise UserError(f"gemma config: hidden_activation={act!r} is not supported (only gelu_pytorch_tanh)")
        if d.get("attention_bias"):
            raise UserError("gemma config: attention_bias=true is not supported")
        if d.get("rope_scaling"):
            raise UserError(f"gemma config: rope_scaling={d['rope_scaling']!r} is not supported")
        heads = d["num_attention_heads"]
        return cls(
            num_layers=d["num_hidden_layers"],
            hidden_size=d["hidden_size"],
            num_attention_heads=heads,
            num_query_groups=d.get("num_key_value_heads", heads),
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            ffn_hidden_size=d["intermediate_size"],
            vocab_size=d["vocab_size"],
            norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=d.get("rope_theta", 10000.0),
            max_position_embeddings=d.get("max_position_embeddings", 8192),
        )


L = "layers.{i}."
H = "layers.{i}."

GEMMA_TABLE = (
    Row("embed_tokens.weight", ("embed_tokens.weight",), optional=True),  # the pi0 action expert has none
    Row(L + "input_norm.weight", (H + "input_layernorm.weight",), optional=True),
    Row(L + "input_norm.dense.weight", (H + "input_layernorm.dense.weight",), optional=True),
    Row(L + "input_norm.dense.bias", (H + "input_layernorm.dense.bias",), optional=True),
    Row(L + "linear_qkv.weight", tuple(H + f"self_attn.{p}_proj.weight" for p in "qkv"), "qkv"),
    Row(L + "linear_proj.weight", (H + "self_attn.o_proj.weight",)),
    Row(L + "post_attn_norm.weight", (H + "post_attention_layernorm.weight",), optional=True),
    Row(L + "post_attn_norm.dense.weight", (H + "post_attention_layernorm.dense.weight",), optional=True),
    Row(L + "post_attn_norm.dense.bias", (H + "post_attention_layernorm.dense.bias",), optional=True),
    Row(L + "linear_fc1.weight", (H + "mlp.gate_proj.weight", H + "mlp.up_proj.weight"), "concat"),
    Row(L + "linear_fc2.weight", (H + "mlp.down_proj.weight",)),
    Row("final_norm.weight", ("norm.weight",), optional=True),
    Row("final_norm.dense.weight", ("norm.dense.weight",), optional=True),
    Row("final_norm.dense.bias", ("norm.dense.bias",), optional=True),
)


GEMMA_CAUSAL_LM_TABLE = prefixed(GEMMA_TABLE, hf_prefix="model.")  # HF `GemmaForCausalLM`; lm_head is tied


class GemmaRMSNorm(nn.Module):
    """`norm(x, cond=None)` -> (rms(x) * (1 + weight), None), computed in fp32 and cast back (the
    op table's `gemma_rms_norm`)."""

    def __init__(self, dim: int, eps: float, ops: OpTable):
        super().__init__()
        self.eps, self.ops = eps, ops
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor, cond: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        return self.ops.gemma_rms_norm(x, self.weight, self.eps), None


class AdaRMSNorm(nn.Module):
    """`norm(x, cond)` -> (rms(x) * (1 + scale) + shift, gate) with [scale | shift | gate] =
    dense(cond); cond [b, cond_dim] broadcasts over x's sequence axis. Zero-initialized, so an
    untrained norm is a plain RMSNorm whose residual branch is gated shut."""

    def __init__(self, dim: int, eps: float, cond_dim: int):
        super().__init__()
        self.eps = eps
        self.dense = nn.Linear(cond_dim, 3 * dim)
        nn.init.zeros_(self.dense.weight)
        nn.init.zeros_(self.dense.bias)

    def forward(self, x: torch.Tensor, cond: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if cond is None:
            raise ValueError("an adaptive RMSNorm needs its conditioning vector (cond)")
        mod = self.dense(cond.to(self.dense.weight.dtype))
        if x.dim() == 3:
            mod = mod.unsqueeze(1)
        scale, shift, gate = mod.chunk(3, dim=-1)
        return (rms_normalized(x, self.eps) * (1 + scale.float()) + shift.float()).to(x.dtype), gate.to(x.dtype)


def _norm(cfg: GemmaConfig, ops: OpTable) -> nn.Module:
    if cfg.adarms_cond_dim:
        return AdaRMSNorm(cfg.hidden_size, cfg.norm_eps, cfg.adarms_cond_dim)
    return GemmaRMSNorm(cfg.hidden_size, cfg.norm_eps, ops)


def gated_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    return x + y if gate is None else x + y * gate


def attention_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive form [b, 1, s, t] of a bool mask [b, s, t] (True: may attend): build it once
    per forward and hand it to every layer."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, MASK_VALUE).unsqueeze(1)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """SDPA over q [b, heads, s, d] and k/v [b, groups, t, d] (GQA when groups < heads); `mask`
    bool [b, s, t] (True: may attend), or its `attention_bias`, or None for causal (s == t)."""
    gqa = q.shape[1] != k.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    bias = attention_bias(mask, q.dtype) if mask.dtype == torch.bool else mask.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=gqa)


class GemmaLayer(nn.Module):
    def __init__(self, cfg: GemmaConfig, ops: OpTable):
        super().__init__()
        self.cfg, self.ops = cfg, ops
        h, d, g = cfg.hidden_size, cfg.head_dim, cfg.num_query_groups
        self.q_per_group = cfg.num_attention_heads // g
        self.input_norm = _norm(cfg, ops)
        self.linear_qkv = nn.Linear(h, g * (self.q_per_group + 2) * d, bias=False)
        self.linear_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)
        self.post_attn_norm = _norm(cfg, ops)
        self.linear_fc1 = nn.Linear(h, 2 * cfg.ffn_hidden_size, bias=False)
        self.linear_fc2 = nn.Linear(cfg.ffn_hidden_size, h, bias=False)

    def attention_inputs(self, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, cond=None):
        """(q [b, heads, s, d], k, v [b, groups, s, d], gate of the attention residual)."""
        normed, gate = self.input_norm(x, cond)
        b, s, _ = x.shape
        d, g = self.cfg.head_dim, self.cfg.num_query_groups
        mixed = self.linear_qkv(normed).view(b, s, g, (self.q_per_group + 2) * d)
        q, k, v = torch.split(mixed, [self.q_per_group * d, d, d], dim=3)
        q, k = self.ops.rope(q.reshape(b, s, g * self.q_per_group, d), k, positions, inv_freq)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), gate

    def finish(self, x: torch.Tensor, attn: torch.Tensor, gate, cond=None) -> torch.Tensor:
        """The rest of the layer after attention: attn [b, heads, s, d] -> the layer's output."""
        b, _, s, _ = attn.shape
        x = gated_residual(x, self.linear_proj(attn.transpose(1, 2).reshape(b, s, -1)), gate)
        normed, gate = self.post_attn_norm(x, cond)
        return gated_residual(x, self.linear_fc2(self.ops.geglu(self.linear_fc1(normed))), gate)

    def forward(self, x, positions=None, inv_freq=None, mask=None, cond=None, *, phase: str = "full", attn=None, gate=None):
        """The whole layer (`phase="full"`), or one half of it through the module call, so that
        hooks on the layer (FSDP's parameter gathering, recompute, compile) also serve a caller
        that runs the attention itself: `phase="inputs"` returns `attention_inputs(x, positions,
        inv_freq, cond)`, `phase="finish"` returns `finish(x, attn, gate, cond)`."""
        if phase == "inputs":
            return self.attention_inputs(x, positions, inv_freq, cond)
        if phase == "finish":
            return self.finish(x, attn, gate, cond)
        q, k, v, gate = self.attention_inputs(x, positions, inv_freq, cond)
        return self.finish(x, masked_attention(q, k, v, mask), gate, cond)


class GemmaModel(nn.Module):
    """A Gemma decoder. `embed(ids)` gives scaled token embeddings, `forward(hidden, positions,
    mask=None, cond=None)` the final-normed hidden states (causal when `mask` is None), `logits`
    the tied output projection. `embedding=False` builds a decoder that only takes embeddings
    (the pi0 action expert)."""

    def __init__(self, cfg: GemmaConfig, ops: OpTable | None = None, embedding: bool = True):
        super().__init__()
        cfg.check()
        ops = ops or OpTable()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if embedding else None
        self.layers = nn.ModuleList(GemmaLayer(cfg, ops) for _ in range(cfg.num_layers))
        self.final_norm = _norm(cfg, ops)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta), persistent=False)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        e = self.embed_tokens(ids)
        # HF multiplies by sqrt(hidden) rounded to the embedding's dtype
        return e * torch.tensor(math.sqrt(self.cfg.hidden_size), dtype=e.dtype)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor | None = None, mask=None, cond=None) -> torch.Tensor:
        if positions is None:
            positions = torch.arange(hidden.shape[1], device=hidden.device)
        if mask is not None and mask.dtype == torch.bool:
            mask = attention_bias(mask, hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, positions, self.inv_freq, mask, cond)
        return self.final_norm(hidden, cond)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.embed_tokens.weight.to(hidden.dtype).T

    def blocks(self) -> list[nn.Module]:
        return list(self.layers)
