"""Plain-torch reference implementations of the op table. Every faster kernel is tested
against these."""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F


def rms_normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x over its root mean square along the last dimension, in fp32 (the norms' shared part)."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, cast back to the input dtype before the weight (as HF Llama)."""
    return weight * rms_normalized(x, eps).to(x.dtype)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: rms(x) * (1 + weight), all in fp32, cast to the input dtype at the end."""
    return (rms_normalized(x, eps) * (1.0 + weight.float())).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-norm block's residual add fused with the next norm: (rms_norm(x + residual), x + residual)."""
    s = x + residual
    return rms_norm(s, weight, eps), s


def rope_inv_freq(rotary_dim: int, base: float, scaling: Optional[dict] = None) -> torch.Tensor:
    """Inverse frequencies for rotary embeddings over `rotary_dim` channels.

    `scaling` follows HF's `rope_scaling` dict; supported: None, {"rope_type": "default"},
    {"rope_type": "linear", "factor"}, and {"rope_type": "llama3", "factor", "low_freq_factor",
    "high_freq_factor", "original_max_position_embeddings"}.
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term for a context extended `scale` times."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_rope(rotary_dim: int, base: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN rotary embedding (HF's `rope_type: yarn`): (inverse frequencies over `rotary_dim`
    channels, the factor HF multiplies cos and sin by). `scaling` holds `factor`,
    `original_max_position_embeddings` and optionally `beta_fast` (32), `beta_slow` (1),
    `mscale`, `mscale_all_dim`, `attention_factor`, `truncate` (true)."""
    factor = float(scaling["factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations):  # the channel whose wavelength makes `rotations` turns over old_len
        return rotary_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    extrapolation = 1 - ramp  # 1: keep the original frequency, 0: interpolate it by `factor`
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, interleaved: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of an attention layer's queries and keys (one op, so that kernels rotate
    both in one pass) on the first 2*len(inv_freq) channels: half-split pairs (c, c + rot/2)
    (HF/NeoX layout) or, with `interleaved`, adjacent pairs (2c, 2c + 1) (GPT-J/Meta layout).

    q: [batch, seq, heads, head_dim], k: [batch, seq, kv_heads, head_dim]; positions: [batch, seq]
    or [seq]. Channels past the rotary dimension (partial rotary) pass through unchanged.
    Computed in fp32. Returns (q', k').
    """
    if positions.dim() == 1:
        positions = positions.unsqueeze(0)
    freqs = positions.float().unsqueeze(-1) * inv_freq.float().to(q.device)  # [b, s, rot/2]
    cos, sin = freqs.cos().unsqueeze(2), freqs.sin().unsqueeze(2)  # [b, s, 1, rot/2]
    return _rotate(q, cos, sin, interleaved), _rotate(k, cos, sin, interleaved)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    rot = 2 * cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    xf = x_rot.float()
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    else:
        x1, x2 = xf[..., : rot // 2], xf[..., rot // 2 :]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    out = out.to(x.dtype)
    return torch.cat([out, x_pass], dim=-1) if x_pass.numel() else out


def rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding with the angles given: each token's cos / sin per channel pair, broadcast
    over the heads (`cos`, `sin`: [..., seq, 1, rot/2] against q/k [..., seq, heads, head_dim]).
    Multi-axis RoPE (a video's time / height / width, or M-RoPE's position rows) differs only in
    how the angles are made, so it is this op with tables built by the model. Pairs are adjacent
    channels (2c, 2c + 1) with `interleaved` (Wan, Meta), else (c, c + rot/2) (HF/NeoX). Computed
    in fp32; channels past the rotary dimension pass through. Returns (q', k')."""
    return _rotate(q, cos.float(), sin.float(), interleaved), _rotate(k, cos.float(), sin.float(), interleaved)


def qkv_rope(
    mixed: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, q_per_group: int, interleaved: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split megatron's fused q/k/v projection and rotate q and k (`rope`), in one op so that
    fused implementations read the projection once and write its gradient in one piece.

    mixed: [seq, batch, groups, (q_per_group + 2) * head_dim], each group laid out
    [q_1 .. q_r | k | v] (megatron's GQA layout); positions: [batch, seq] or [seq].
    Returns q [seq, batch, groups * q_per_group, head_dim], k and v [seq, batch, groups, head_dim];
    their memory layout is the implementation's (only the values are specified).
    """
    s, b, g, width = mixed.shape
    d = width // (q_per_group + 2)
    q, k, v = torch.split(mixed, [q_per_group * d, d, d], dim=3)
    q = q.reshape(s, b, g * q_per_group, d)
    q, k = rope(q.transpose(0, 1), k.transpose(0, 1), positions, inv_freq, interleaved)
    return q.transpose(0, 1), k.transpose(0, 1), v


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """LayerNorm over the last dimension (the vision towers': SigLIP, Qwen3-VL)."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU, exact or `approximate="tanh"` (the vision towers' MLPs and projectors)."""
    return F.gelu(x, approximate=approximate)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a [..., 2*ffn] tensor laid out [gate | up]: silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def geglu(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU on a [..., 2*ffn] tensor laid out [gate | up]: gelu_tanh(gate) * up (Gemma's MLP)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, scale: Optional[float] = None) -> torch.Tensor:
    """Attention on [batch, heads, seq, head_dim] through torch SDPA; GQA when k/v have fewer
    heads (repeated to match). Never materializes scores itself: SDPA picks flash/efficient
    kernels on GPU."""
    hq, hk = q.shape[1], k.shape[1]
    if hq != hk:
        k = k.repeat_interleave(hq // hk, dim=1)
        v = v.repeat_interleave(hq // hk, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    token_weights: torch.Tensor,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """sum_i token_weights[i] * CE(hidden[i] @ weight.T, labels[i]): the output projection and the
    loss in one op (fused implementations never hold all the [tokens, vocab] logits). hidden
    [N, H], weight [V, H], labels/token_weights [N]; ignored labels contribute 0. fp32 result.
    Label smoothing as torch: (1 - eps) * CE + eps * mean over the vocabulary of -log p."""
    logits = (hidden @ weight.to(hidden.dtype).T).float()
    loss = F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing)
    return (loss * token_weights.float()).sum()


def moe_permute(tokens: torch.Tensor, expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group a MoE layer's token copies by expert. tokens [N, H]; expert_ids [N, k] (top-k
    choices). Returns (permuted [N*k, H] with expert 0's rows first, stably by token; row_ids
    [N*k]: the flat (token*k + j) index of each permuted row; tokens_per_expert [num_experts])."""
    row_ids, tokens_per_expert = moe_order(expert_ids, num_experts)
    return tokens[row_ids // expert_ids.shape[1]], row_ids, tokens_per_expert


def moe_order(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The permuted order of a MoE layer's token copies: (row_ids [N*k], tokens_per_expert
    [num_experts]) as `moe_permute` returns them. Never waits for the device (no host copy), so
    a CUDA graph can hold it."""
    # narrow keys: the GPU radix sort makes one pass per key byte
    keys = expert_ids.reshape(-1).to(torch.int16 if num_experts <= torch.iinfo(torch.int16).max else torch.int32)
    keys, row_ids = torch.sort(keys, stable=True)
    bounds = torch.searchsorted(keys, torch.arange(num_experts + 1, dtype=keys.dtype, device=keys.device))
    return row_ids, bounds.diff()


def moe_expert_mlp(
    permuted: torch.Tensor, tokens_per_expert: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, swiglu: Callable = swiglu
) -> torch.Tensor:
    """Each expert's SwiGLU MLP on its rows of `permuted` [T, H] (as `moe_permute` groups them,
    `tokens_per_expert` [E] rows each): rows of expert e -> swiglu(x @ fc1[e].T) @ fc2[e].T, with
    fc1 [E, 2F, H] (gate rows, then up rows) and fc2 [E, H, F]; `swiglu` is the caller's op table's.
    The reference loops over the experts (reading the counts on the host); `grouped_mm` runs them
    as two grouped GEMMs."""
    out = []
    for e, rows in enumerate(permuted.split(tokens_per_expert.tolist())):
        out.append(F.linear(swiglu(F.linear(rows, fc1[e])), fc2[e]))
    return torch.cat(out) if out else permuted.new_empty(0, fc2.shape[1])


def moe_unpermute(permuted: torch.Tensor, row_ids: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Inverse of moe_permute, combining each token's k expert outputs weighted by probs [N, k]:
    out[t] = sum_j probs[t, j] * permuted[position of (t, j)]. Computed in fp32."""
    n, k = probs.shape
    flat = torch.empty_like(permuted, dtype=torch.float32)
    flat[row_ids] = permuted.float()
    return (flat.view(n, k, -1) * probs.float().unsqueeze(-1)).sum(1).to(permuted.dtype)


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Position ids that restart at 0 at every packed sample: [total]."""
    idx = torch.arange(total, device=cu_seqlens.device)
    starts = cu_seqlens[:-1].to(idx.device)
    seg = torch.searchsorted(cu_seqlens[1:].to(idx.device).contiguous(), idx, right=True)
    return idx - starts[seg]


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: Optional[float] = None,
    max_seqlen: Optional[int] = None,
) -> torch.Tensor:
    """Causal attention over packed samples that never crosses a sample boundary.

    q: [total, heads, head_dim], k: [total, kv_heads, head_dim], v: [total, kv_heads, v_head_dim]
    (v_head_dim may differ, as in MLA), cu_seqlens: [n + 1] offsets, max_seqlen: the longest
    sample (a hint for kernels that size their grid by it). Returns [total, heads, v_head_dim].
    The reference runs SDPA per sample (exact; faster kernels take the whole pack at once).
    """
    if cu_seqlens.shape[0] == 2:
        return _whole_rows(q, k, v, True, scale)
    bounds = cu_seqlens.tolist()
    return _per_sample(q, k, v, bounds, bounds, True, scale)


def _whole_rows(q, k, v, causal: bool, scale) -> torch.Tensor:
    """SDPA over a one-sample pack's whole rows (read without a device sync of the bounds)."""
    return attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], causal, scale)[0].transpose(0, 1)


def _per_sample(q, k, v, bq: list, bk: list, causal: bool, scale) -> torch.Tensor:
    """SDPA of each packed sample's queries q[bq[i]:bq[i+1]] on its keys k[bk[i]:bk[i+1]]."""
    out = q.new_empty(*q.shape[:2], v.shape[-1])
    for (qs, qe), (ks, ke) in zip(zip(bq[:-1], bq[1:]), zip(bk[:-1], bk[1:])):
        if qe > qs:
            seg = attention(q[qs:qe].transpose(0, 1)[None], k[ks:ke].transpose(0, 1)[None], v[ks:ke].transpose(0, 1)[None], causal, scale)
            out[qs:qe] = seg[0].transpose(0, 1)
    return out


def adamw(
    params: list,
    grads: list,
    exp_avgs: list,
    exp_avg_sqs: list,
    steps: list,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
    grad_scale: Optional[torch.Tensor] = None,
    found_inf: Optional[torch.Tensor] = None,
) -> None:
    """One AdamW update in place over lists of tensors (torch.optim.AdamW's math: decoupled weight
    decay, bias-corrected moments, fp32 arithmetic whatever the storage dtype). `steps` are the
    per-parameter step counts (fp32 0-d tensors), already counting this update; each gradient is
    divided by `grad_scale` (0-d tensor) as it is read. A nonzero `found_inf` (fp32 0-d tensor on
    the device) leaves parameters and moments untouched, decided on the device (torch's GradScaler
    contract; the caller keeps the step counts). The reference is torch's own fused kernel."""
    if params:
        torch._fused_adamw_(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=weight_decay,
            eps=eps,
            amsgrad=False,
            maximize=False,
            grad_scale=grad_scale,
            found_inf=found_inf,
        )


def sum_squares(tensors: list) -> torch.Tensor:
    """Sum of the squares of every element of `tensors` (a non-empty list on one device) as an
    fp32 0-d tensor, as clipping's global gradient norm needs it: torch's fused per-tensor norm
    in fp32 (bf16 tensors are read once and never copied), squared and summed."""
    return torch.stack(torch._foreach_norm(tensors, 2.0, dtype=torch.float32)).square().sum()


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: Optional[float] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
) -> torch.Tensor:
    """Bidirectional attention over packed samples: sample i's queries q[cu_q[i]:cu_q[i+1]] attend
    to its keys k[cu_k[i]:cu_k[i+1]] and nothing else (self-attention inside each sample of a pack
    when the bounds are equal; cross-attention to each sample's own context otherwise).

    q: [total_q, heads, head_dim], k/v: [total_k, kv_heads, head_dim]; returns [total_q, heads,
    head_dim]. `max_seqlen_*` are hints for kernels. The reference runs SDPA per sample.
    """
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ValueError(f"packed_attention: {cu_seqlens_q.shape[0] - 1} query samples but {cu_seqlens_k.shape[0] - 1} key samples")
    if cu_seqlens_q.shape[0] == 2:
        return _whole_rows(q, k, v, False, scale)
    return _per_sample(q, k, v, cu_seqlens_q.tolist(), cu_seqlens_k.tolist(), False, scale)
