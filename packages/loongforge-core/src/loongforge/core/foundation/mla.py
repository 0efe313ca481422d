"""Multi-head latent attention (MLA, DeepSeek-V2/V3) as a megatron-core self-attention module:
megatron's parallel linears (heads split over tensor-parallel ranks), the rotary embedding and
attention through the op table.

Queries come from the hidden state directly or through a low-rank latent (`q_lora_rank`); keys
and values are expanded per head from one latent of width `kv_lora_rank`, beside one rotary key
channel block shared by every head. Each head's query and key are `qk_nope_head_dim` channels
without rotary embedding followed by `qk_rope_head_dim` rotated ones; values are `v_head_dim`.

Built as its own module rather than on megatron-core's `MLASelfAttention`, which without
transformer-engine believes TE is present (its `HAVE_TE` comes from TE's stub module and an
`isinstance` against a stub raises), passes `k_channels`/`v_channels` its local core attention
does not take, and brings its own YaRN: here the rotary frequencies and YaRN's scales are the
op table's (`yarn_rope`), the same math as HF's DeepSeek-V3, and the rotary and attention
kernels are the ones every other family uses.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch
from loongforge.core.ops import OpTable
from torch import nn


@dataclass(frozen=True)
class MLADims:
    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool


def mla_rope(cfg) -> tuple[torch.Tensor, float, float]:
    """(inverse frequencies over the rotary channels, the factor the rotated channels are
    multiplied by, the softmax scale) of a model config, as HF's DeepSeek-V3 computes them."""
    from loongforge.core.ops.reference import rope_inv_freq, yarn_mscale, yarn_rope

    scaling = cfg.rope_scaling or {}
    scale = 1.0 / math.sqrt(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    if scaling.get("rope_type", scaling.get("type")) == "yarn":
        inv_freq, rotary_factor = yarn_rope(cfg.qk_rope_head_dim, cfg.rope_theta, scaling)
        if scaling.get("mscale_all_dim"):
            scale *= yarn_mscale(float(scaling["factor"]), scaling["mscale_all_dim"]) ** 2
        return inv_freq, rotary_factor, scale
    return rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling), 1.0, scale


class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over `group`. megatron-core's
    `copy_to_tensor_model_parallel_region` does the same but all-reduces a contiguous copy and
    returns the gradient unreduced when it arrives non-contiguous (as the rotary key's does)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReplicatedLinear(nn.Module):
    """y = x W^T with the whole weight on every tensor-parallel rank (MLA's down projections,
    whose outputs every head needs); megatron's (output, bias) return convention. Under sequence
    parallelism it projects this rank's share of the sequence (its gradient sums over TP)."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method, bias: bool = False, **_):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        with torch.no_grad():
            init_method(self.weight)
        if config.sequence_parallel:
            self.weight.sequence_parallel = True

    def forward(self, x: torch.Tensor):
        return torch.nn.functional.linear(x, self.weight), None


@dataclass
class MLASubmodules:
    linear_q_proj: object = None  # without a query latent
    linear_q_down_proj: object = None  # with one: down, norm, up
    q_layernorm: object = None
    linear_q_up_proj: object = None
    linear_kv_down_proj: object = None
    kv_layernorm: object = None
    linear_kv_up_proj: object = None
    linear_proj: object = None


@functools.cache
def mla_attention_class():
    """A factory, so that importing this module does not import megatron-core."""
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.spec_utils import build_module

    class MLASelfAttention(MegatronModule):
        def __init__(
            self,
            config,
            submodules: MLASubmodules,
            layer_number: int,
            attn_mask_type=None,
            pg_collection=None,
            ops: OpTable | None = None,
            dims: MLADims | None = None,
            inv_freq: torch.Tensor | None = None,
            rotary_factor: float = 1.0,
            softmax_scale: float | None = None,
            **_,
        ):
            super().__init__(config=config)
            self.ops = ops or OpTable()
            self.dims = d = dims
            self.layer_number = layer_number
            self.tp_group = pg_collection.tp
            tp = self.tp_group.size()
            self.heads = config.num_attention_heads // tp
            self.rotary_factor = rotary_factor
            self.softmax_scale = softmax_scale
            self.register_buffer("inv_freq", inv_freq, persistent=False)
            h, qk = config.hidden_size, d.qk_nope_head_dim + d.qk_rope_head_dim
            column = dict(config=config, init_method=config.init_method, bias=False, gather_output=False, tp_group=self.tp_group)
            if d.q_lora_rank:
                self.linear_q_down_proj = build_module(
                    submodules.linear_q_down_proj, h, d.q_lora_rank, config=config, init_method=config.init_method
                )
                # HF's DeepSeek-V3 builds the latent norms with their default eps (1e-6), not the model's
                self.q_layernorm = build_module(submodules.q_layernorm, config=config, hidden_size=d.q_lora_rank, eps=1e-6)
                self.linear_q_up_proj = build_module(submodules.linear_q_up_proj, d.q_lora_rank, config.num_attention_heads * qk, **column)
            else:
                self.linear_q_proj = build_module(submodules.linear_q_proj, h, config.num_attention_heads * qk, **column)
            self.linear_kv_down_proj = build_module(
                submodules.linear_kv_down_proj, h, d.kv_lora_rank + d.qk_rope_head_dim, config=config, init_method=config.init_method
            )
            self.kv_layernorm = build_module(submodules.kv_layernorm, config=config, hidden_size=d.kv_lora_rank, eps=1e-6)
            self.linear_kv_up_proj = build_module(
                submodules.linear_kv_up_proj, d.kv_lora_rank, config.num_attention_heads * (d.qk_nope_head_dim + d.v_head_dim), **column
            )
            self.linear_proj = build_module(
                submodules.linear_proj,
                config.num_attention_heads * d.v_head_dim,
                h,
                config=config,
                init_method=config.output_layer_init_method,
                bias=False,
                input_is_parallel=True,
                skip_bias_add=True,
                tp_group=self.tp_group,
            )

        def forward(self, hidden_states, attention_mask=None, packed_seq_params=None, **kwargs):
            """hidden_states [seq, batch, hidden] (THD packs: batch 1; under sequence parallelism
            this rank's share of the sequence) -> (output, None)."""
            from loongforge.core.foundation.layers import RotarySDPAttention, _cu_seqlens
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            special = [k for k, v in kwargs.items() if v is not None and k != "sequence_len_offset"]
            if special:
                raise NotImplementedError(f"multi-head latent attention does not take {special[0]} (inference caches are not built)")
            d = self.dims
            # the down projections and latent norms see this rank's tokens; the up projections
            # (column-parallel) gather the whole sequence under sequence parallelism
            if d.q_lora_rank:
                q, _ = self.linear_q_up_proj(self.q_layernorm(self.linear_q_down_proj(hidden_states)[0]))
            else:
                q, _ = self.linear_q_proj(hidden_states)
            s, b = q.shape[:2]
            q = q.view(s, b, self.heads, -1)
            latent, k_rot = self.linear_kv_down_proj(hidden_states)[0].split([d.kv_lora_rank, d.qk_rope_head_dim], dim=-1)
            kv, _ = self.linear_kv_up_proj(self.kv_layernorm(latent))
            k_nope, v = kv.view(s, b, self.heads, -1).split([d.qk_nope_head_dim, d.v_head_dim], dim=-1)
            # each rank's heads use the shared rotary key: its gradient sums over them (the
            # sequence gather's backward is a reduce-scatter, which sums too)
            if self.config.sequence_parallel:
                k_rot = gather_from_sequence_parallel_region(k_rot, group=self.tp_group)
            elif self.tp_group.size() > 1:
                k_rot = _SumGradOverGroup.apply(k_rot, self.tp_group)
            q_nope, q_rot = q.split([d.qk_nope_head_dim, d.qk_rope_head_dim], dim=-1)
            positions = RotarySDPAttention.positions(packed_seq_params, s, q.device)
            # [s, b, ...] -> [b, s, ...] for the rotary op
            q_rot, k_rot = self.ops.rope(
                q_rot.transpose(0, 1), k_rot.unsqueeze(2).transpose(0, 1), positions, self.inv_freq, d.rope_interleave
            )
            if self.rotary_factor != 1.0:
                q_rot, k_rot = q_rot * self.rotary_factor, k_rot * self.rotary_factor
            q = torch.cat([q_nope.transpose(0, 1), q_rot], dim=-1)  # [b, s, heads, qk]
            k = torch.cat([k_nope.transpose(0, 1), k_rot.expand(-1, -1, self.heads, -1)], dim=-1)
            v = v.transpose(0, 1)
            if packed_seq_params is not None:  # THD: megatron's batch of one
                out = self.ops.varlen_attention(
                    q[0], k[0], v[0], _cu_seqlens(packed_seq_params), self.softmax_scale, packed_seq_params.max_seqlen_q
                )
                out = out.reshape(s, 1, -1)
            else:
                out = self.ops.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, scale=self.softmax_scale)
                out = out.permute(2, 0, 1, 3).reshape(s, b, -1)
            return self.linear_proj(out)

    return MLASelfAttention
