"""Plain-torch reference implementations of the op table. Every faster kernel is tested
against these."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, cast back to the input dtype before the weight (as HF Llama)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_inv_freq(
    rotary_dim: int, base: float, scaling: Optional[dict] = None
) -> torch.Tensor:
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


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Half-split (HF/NeoX layout) rotary embedding on the first 2*len(inv_freq) channels.

    x: [batch, seq, heads, head_dim]; positions: [batch, seq] or [seq]. Channels past the rotary
    dimension (partial rotary) pass through unchanged. Computed in fp32.
    """
    rot = 2 * inv_freq.numel()
    if positions.dim() == 1:
        positions = positions.unsqueeze(0)
    freqs = positions.float().unsqueeze(-1) * inv_freq.float().to(x.device)  # [b, s, rot/2]
    emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(2)  # [b, s, 1, rot]
    cos, sin = emb.cos(), emb.sin()
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    xf = x_rot.float()
    x1, x2 = xf[..., : rot // 2], xf[..., rot // 2 :]
    rotated = torch.cat([-x2, x1], dim=-1)
    out = (xf * cos + rotated * sin).to(x.dtype)
    return torch.cat([out, x_pass], dim=-1) if x_pass.numel() else out


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a [..., 2*ffn] tensor laid out [gate | up]: silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, scale: Optional[float] = None
) -> torch.Tensor:
    """Attention on [batch, heads, seq, head_dim] through torch SDPA; GQA when k/v have fewer
    heads (repeated to match). Never materializes scores itself: SDPA picks flash/efficient
    kernels on GPU."""
    hq, hk = q.shape[1], k.shape[1]
    if hq != hk:
        k = k.repeat_interleave(hq // hk, dim=1)
        v = v.repeat_interleave(hq // hk, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Per-token cross entropy in fp32, 0 where labels == ignore_index. logits [..., vocab]."""
    flat = logits.reshape(-1, logits.shape[-1]).float()
    loss = F.cross_entropy(flat, labels.reshape(-1), ignore_index=ignore_index, reduction="none")
    return loss.view(labels.shape)


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Position ids that restart at 0 at every packed sample: [total]."""
    idx = torch.arange(total, device=cu_seqlens.device)
    starts = cu_seqlens[:-1].to(idx.device)
    seg = torch.searchsorted(cu_seqlens[1:].to(idx.device).contiguous(), idx, right=True)
    return idx - starts[seg]


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: Optional[float] = None
) -> torch.Tensor:
    """Causal attention over packed samples that never crosses a sample boundary.

    q: [total, heads, head_dim], k/v: [total, kv_heads, head_dim], cu_seqlens: [n + 1] offsets.
    The reference runs SDPA per sample (exact; faster kernels take the whole pack at once).
    """
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            seg = attention(q[start:end].transpose(0, 1)[None], k[start:end].transpose(0, 1)[None], v[start:end].transpose(0, 1)[None], True, scale)
            out[start:end] = seg[0].transpose(0, 1)
    return out
