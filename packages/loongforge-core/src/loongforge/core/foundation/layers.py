"""Layer modules that plug into megatron-core's `ModuleSpec` and compute through the op table.

megatron-core builds them with its own keyword arguments; the op table arrives through the
spec's `params`, so each model holds the implementations it was built with.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import nn

from loongforge.core.ops import OpTable


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension (megatron builds it as `norm(config=, hidden_size=, eps=)`)."""

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-6, ops: OpTable | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=getattr(config, "params_dtype", torch.float32)))
        self.eps = eps
        self.ops = ops or OpTable()
        if config is not None and getattr(config, "sequence_parallel", False):
            self.weight.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class RotarySDPAttention(nn.Module):
    """megatron-core `core_attention` replacement: rotary embedding (op `rope`) then causal
    attention (op `attention`, torch SDPA in the reference) on megatron's [seq, batch, heads,
    head_dim] tensors. Never builds the [seq, seq] score matrix itself."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type=None,
        attention_type: str = "self",
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type=None,
        pg_collection=None,
        ops: OpTable | None = None,
        inv_freq: torch.Tensor | None = None,
    ):
        super().__init__()
        self.ops = ops or OpTable()
        self.softmax_scale = softmax_scale
        # A buffer, not a parameter: not trained and not checkpointed (derived from the config).
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        seq = query.shape[0]
        positions = torch.arange(seq, device=query.device)
        q = query.transpose(0, 1)  # [b, s, h, d]
        k = key.transpose(0, 1)
        v = value.transpose(0, 1)
        if self.inv_freq is not None:
            q = self.ops.rope(q, positions, self.inv_freq)
            k = self.ops.rope(k, positions, self.inv_freq)
        out = self.ops.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, scale=self.softmax_scale)
        b, h, s, d = out.shape
        return out.permute(2, 0, 1, 3).reshape(s, b, h * d)

    def _packed(self, query, key, value, params):
        """THD layout ([total, heads, head_dim], megatron squeezes the batch of 1): positions
        restart per sample and attention stays inside each sample."""
        if params.qkv_format != "thd":
            raise ValueError(f"packed sequences must use qkv_format='thd', got {params.qkv_format!r}")
        cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        total = query.shape[0]
        q, k = query, key
        if self.inv_freq is not None:
            from loongforge.core.ops.reference import positions_from_cu_seqlens

            pos = positions_from_cu_seqlens(cu, total)
            q = self.ops.rope(q[None], pos, self.inv_freq)[0]
            k = self.ops.rope(k[None], pos, self.inv_freq)[0]
        out = self.ops.varlen_attention(q, k, value, cu, self.softmax_scale, params.max_seqlen_q)
        return out.reshape(total, -1)


@functools.cache
def swiglu_mlp_class():
    """megatron-core's MLP (its parallel linears and its TP-aware sharded checkpoint layout of the
    fused gate/up weight) with the activation computed by the op table's `swiglu`.

    A factory, so that importing this module does not import megatron-core.
    """
    from megatron.core.transformer.mlp import MLP

    class SwiGLUMLP(MLP):
        def __init__(self, config, submodules, ops: OpTable | None = None, **kwargs):
            super().__init__(config, submodules, **kwargs)
            self.ops = ops or OpTable()

        def forward(self, hidden_states, per_token_scale=None, **kwargs):
            if per_token_scale is not None:
                raise NotImplementedError("per-token scaling is a MoE feature; dense MLPs do not take it")
            gate_up, _ = self.linear_fc1(hidden_states)
            out, bias = self.linear_fc2(self.ops.swiglu(gate_up))
            return out, bias

    return SwiGLUMLP
