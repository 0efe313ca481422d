"""Layer modules that plug into megatron-core's `ModuleSpec` and compute through the op table.

megatron-core builds them with its own keyword arguments; the op table arrives through the
spec's `params`, so each model holds the implementations it was built with.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from loongforge.core.ops import OpTable
from loongforge.core.parallel.split_data import SPLIT_DATA_ATTR
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension (megatron builds it as `norm(config=, hidden_size=, eps=)`).
    `per_head`: a q/k norm, applied to each of this TP rank's heads, so its gradient holds those
    heads' share only and sums over the TP group (as under sequence parallelism, where every norm
    sees its rank's share of the sequence)."""

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-6, ops: OpTable | None = None, per_head: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=getattr(config, "params_dtype", torch.float32)))
        self.eps = eps
        self.ops = ops or OpTable()
        if config is not None and getattr(config, "sequence_parallel", False):
            self.weight.sequence_parallel = True
        if per_head:
            setattr(self.weight, SPLIT_DATA_ATTR, True)

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
        """megatron's core-attention call: q/k/v [seq, batch, heads, head_dim] ([tokens, heads,
        head_dim] packed), rotated here (by the pack's own angle tables where it has them), then
        `attend`."""
        tables = rotary_tables(packed_seq_params)
        if tables is not None:
            query, key = (t[0] for t in self.ops.rotary(query[None], key[None], *tables, False))
        elif self.inv_freq is not None:
            pos = self.positions(packed_seq_params, query.shape[0], query.device)
            if packed_seq_params is not None:
                query, key = (t[0] for t in self.ops.rope(query[None], key[None], pos, self.inv_freq))
            else:
                query, key = (t.transpose(0, 1) for t in self.ops.rope(query.transpose(0, 1), key.transpose(0, 1), pos, self.inv_freq))
        return self.attend(query, key, value, packed_seq_params)

    @staticmethod
    def positions(packed_seq_params, seq: int, device) -> torch.Tensor:
        """Rotary positions of `seq` tokens: 0..seq-1, or, in a THD pack, restarting at every sample."""
        if packed_seq_params is None:
            return torch.arange(seq, device=device)
        from loongforge.core.ops.reference import positions_from_cu_seqlens

        return positions_from_cu_seqlens(_cu_seqlens(packed_seq_params), seq)

    def attend(self, q, k, v, packed_seq_params=None) -> torch.Tensor:
        """Causal attention of rotated q/k/v, in any memory layout: [seq, batch, heads, head_dim]
        -> [seq, batch, hidden]; packed, [tokens, heads, head_dim] -> [tokens, hidden] with
        attention inside each sample."""
        if packed_seq_params is not None:
            out = self.ops.varlen_attention(q, k, v, _cu_seqlens(packed_seq_params), self.softmax_scale, packed_seq_params.max_seqlen_q)
            return out.reshape(q.shape[0], -1)
        # [s, b, h, d] -> [b, h, s, d] views (seq-major and batch-major q/k/v measured the same
        # through SDPA, output permute included: docs/benchmarks.md, run 9)
        out = self.ops.attention(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), causal=True, scale=self.softmax_scale)
        b, h, s, d = out.shape
        return out.permute(2, 0, 1, 3).reshape(s, b, h * d)


@functools.cache
def rotary_pack_class():
    """megatron-core's PackedSeqParams with each token's rotary angles: `rotary_cos` / `rotary_sin`
    [tokens, 1, rot / 2] (op `rotary`'s tables, half-split pairs), and `layer_additions` (see
    `add_layer_additions`). Models whose positions are not
    0..n-1 in each sample (M-RoPE's three rows) build them once per forward; every attention layer
    of the pack rotates by them instead of by its own positions.

    A factory, so that importing this module does not import megatron-core."""
    from dataclasses import dataclass

    from megatron.core.packed_seq_params import PackedSeqParams

    @dataclass
    class RotaryPackedSeqParams(PackedSeqParams):
        rotary_cos: Optional[torch.Tensor] = None
        rotary_sin: Optional[torch.Tensor] = None
        # decoder layer (0-based) -> a tensor added to its output (Qwen3-VL's DeepStack features
        # at the vision tokens): riding with the pack, they reach a layer recomputed in backward too
        layer_additions: Optional[dict] = None

    return RotaryPackedSeqParams


def add_layer_additions(layers) -> None:
    """Hook megatron decoder layers so that each adds its `packed_seq_params.layer_additions` entry
    (by its 0-based global number) to its output hidden states."""

    def hook(layer, args, kwargs, output):
        additions = getattr(kwargs.get("packed_seq_params"), "layer_additions", None)
        extra = None if not additions else additions.get(layer.layer_number - 1)
        if extra is None:
            return output
        hidden, context = output
        return hidden + extra.to(hidden.dtype), context

    for layer in layers:
        layer.register_forward_hook(hook, with_kwargs=True)


def rotary_tables(packed_seq_params) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The pack's own rotary angle tables (cos, sin), or None."""
    cos = getattr(packed_seq_params, "rotary_cos", None)
    return None if cos is None else (cos, packed_seq_params.rotary_sin)


def _cu_seqlens(params) -> torch.Tensor:
    """A pack's sample boundaries; every packed path reads them here, so the format check is here."""
    if params.qkv_format != "thd":
        raise ValueError(f"packed sequences must use qkv_format='thd', got {params.qkv_format!r}")
    return params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q


@functools.cache
def fused_qkv_attention_class():
    """megatron-core's SelfAttention whose q/k/v split and rotary embedding are one op-table call
    (`qkv_rope`) on the fused projection, feeding `RotarySDPAttention.attend`. Configurations the
    fused path does not cover (q/k norms, output gate, fewer KV groups than TP ranks, attention
    recompute or offload, inference, cross attention) run megatron's own forward unchanged.

    A factory, so that importing this module does not import megatron-core.
    """
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.identity_op import IdentityOp

    class FusedQKVSelfAttention(SelfAttention):
        def __init__(self, config, submodules, layer_number, attn_mask_type=None, ops: OpTable | None = None, **kwargs):
            super().__init__(config, submodules, layer_number, attn_mask_type, **kwargs)
            self.ops = ops or OpTable()
            core = self.core_attention
            self.fused = (
                isinstance(core, RotarySDPAttention)
                and core.inv_freq is not None
                and all(n is None or isinstance(n, IdentityOp) for n in (self.q_layernorm, self.k_layernorm))
                and not getattr(config, "attention_output_gate", False)
                and not config.no_rope_freq
                and config.num_query_groups >= self.world_size
                and not self.checkpoint_core_attention
                and not any(getattr(self, f, False) for f in ("offload_qkv_linear", "offload_core_attention", "offload_attn_proj"))
            )

        def forward(
            self,
            hidden_states,
            attention_mask=None,
            key_value_states=None,
            inference_context=None,
            rotary_pos_emb=None,
            attention_bias=None,
            packed_seq_params=None,
            **kwargs,
        ):
            special = (
                key_value_states,
                inference_context,
                rotary_pos_emb,
                attention_bias,
                rotary_tables(packed_seq_params),
                *kwargs.values(),
            )
            if not self.fused or any(x is not None for x in special):
                return super().forward(
                    hidden_states,
                    attention_mask,
                    key_value_states=key_value_states,
                    inference_context=inference_context,
                    rotary_pos_emb=rotary_pos_emb,
                    attention_bias=attention_bias,
                    packed_seq_params=packed_seq_params,
                    **kwargs,
                )
            mixed, _ = self.linear_qkv(hidden_states)
            s, b = mixed.shape[:2]
            groups = self.num_query_groups_per_partition
            mixed = mixed.view(s, b, groups, -1)
            core = self.core_attention
            positions = core.positions(packed_seq_params, s, mixed.device)
            q, k, v = self.ops.qkv_rope(mixed, positions, core.inv_freq, self.num_attention_heads_per_partition // groups)
            if packed_seq_params is not None:  # THD: megatron's batch of one is squeezed
                out = core.attend(q[:, 0], k[:, 0], v[:, 0], packed_seq_params).reshape(s, 1, -1)
            else:
                out = core.attend(q, k, v)
            return self.linear_proj(out)

    return FusedQKVSelfAttention


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


@functools.cache
def fused_residual_layer_class():
    """megatron-core's TransformerLayer whose attention residual add and MLP norm are one op-table
    call (`add_rms_norm`: the sum and its norm in one pass, and in the backward the norm's input
    gradient and the residual's in one pass). Layers it does not cover (dropout or linear biases,
    a non-RMSNorm MLP norm, cross attention, norm or MLP recompute, activation offload, inference)
    run megatron's own forward unchanged; full-layer recompute wraps this forward as it wraps
    megatron's.

    A factory, so that importing this module does not import megatron-core.
    """
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from megatron.core.utils import make_viewless_tensor

    class FusedResidualTransformerLayer(TransformerLayer):
        def __init__(self, config, submodules, *args, ops: OpTable | None = None, **kwargs):
            super().__init__(config, submodules, *args, **kwargs)
            self.ops = ops or OpTable()
            self.fused = (
                isinstance(self.pre_mlp_layernorm, RMSNorm)
                and self.hidden_dropout == 0.0
                and not config.add_bias_linear
                and isinstance(self.cross_attention, IdentityOp)
                and isinstance(self.pre_cross_attn_layernorm, IdentityOp)
                and not (self.recompute_input_layernorm or self.recompute_pre_mlp_layernorm or self.recompute_mlp)
                and not (self.offload_attn_norm or self.offload_mlp_norm)
            )

        def forward(
            self,
            hidden_states,
            attention_mask=None,
            context=None,
            context_mask=None,
            rotary_pos_emb=None,
            rotary_pos_cos=None,
            rotary_pos_sin=None,
            attention_bias=None,
            inference_context=None,
            packed_seq_params=None,
            **kwargs,
        ):
            special = (
                context,
                context_mask,
                rotary_pos_cos,
                rotary_pos_sin,
                inference_context,
                *(v for k, v in kwargs.items() if k != "padding_mask"),
            )
            if not self.fused or any(x is not None for x in special):
                return super().forward(
                    hidden_states,
                    attention_mask=attention_mask,
                    context=context,
                    context_mask=context_mask,
                    rotary_pos_emb=rotary_pos_emb,
                    rotary_pos_cos=rotary_pos_cos,
                    rotary_pos_sin=rotary_pos_sin,
                    attention_bias=attention_bias,
                    inference_context=inference_context,
                    packed_seq_params=packed_seq_params,
                    **kwargs,
                )
            attn, _ = self.self_attention(
                self.input_layernorm(hidden_states),
                attention_mask=attention_mask,
                rotary_pos_emb=rotary_pos_emb,
                attention_bias=attention_bias,
                packed_seq_params=packed_seq_params,
            )
            norm = self.pre_mlp_layernorm
            normed, hidden = self.ops.add_rms_norm(attn, hidden_states, norm.weight, norm.eps)
            out, _ = self.mlp(normed, padding_mask=kwargs.get("padding_mask"))
            out = out + hidden
            return make_viewless_tensor(inp=out, requires_grad=out.requires_grad, keep_graph=True), context

    return FusedResidualTransformerLayer
