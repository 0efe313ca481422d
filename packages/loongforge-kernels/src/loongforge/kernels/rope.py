"""Rotary embedding forward/backward in Triton: half-split or interleaved pairs, partial rotary
(the channels past the rotary dimension are copied), any inverse frequencies (llama3 / linear
scaling are computed into them), per-token position ids (packed sequences restart them).

One program rotates a block of heads of one token (8 heads, 2 warps: the fastest of a sweep on an
H200); angles are computed in fp32 from the position and the inverse frequency. The backward is
the rotation by the negative angle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loongforge.core.ops import reference
from loongforge.kernels._util import KERNEL_DTYPES


@triton.jit
def token_rotation(POS, INV, HALF, INTERLEAVED: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """One token's rotation: cos and sin of position x inverse frequency (fp32), the two channels
    each pair rotates (half-split or interleaved) and the mask of real pairs."""
    pos = tl.load(POS).to(tl.float32)
    i = tl.arange(0, BLOCK_HALF)
    im = i < HALF
    ang = pos * tl.load(INV + i, mask=im, other=0.0).to(tl.float32)
    if INTERLEAVED:
        c1 = 2 * i
        c2 = 2 * i + 1
    else:
        c1 = i
        c2 = i + HALF
    return tl.cos(ang), tl.sin(ang), c1, c2, im


@triton.jit
def _rope(X, OUT, POS, INV, sxb, sxs, sxh, sob, sos, soh, spb, sps, S, H, D, HALF, SIGN: tl.constexpr,
          INTERLEAVED: tl.constexpr, HAS_PASS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr):
    tok = tl.program_id(0)
    b = (tok // S).to(tl.int64)
    s = (tok % S).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = h < H
    cos, sin, c1, c2, im = token_rotation(POS + b * spb + s * sps, INV, HALF, INTERLEAVED, BLOCK_HALF)
    cos = cos[None, :]
    sin = (sin * SIGN)[None, :]
    xb = X + b * sxb + s * sxs + h[:, None].to(tl.int64) * sxh
    ob = OUT + b * sob + s * sos + h[:, None].to(tl.int64) * soh
    m = hm[:, None] & im[None, :]
    x1 = tl.load(xb + c1[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(xb + c2[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(ob + c1[None, :], (x1 * cos - x2 * sin).to(OUT.dtype.element_ty), mask=m)
    tl.store(ob + c2[None, :], (x2 * cos + x1 * sin).to(OUT.dtype.element_ty), mask=m)
    if HAS_PASS:
        p = tl.arange(0, BLOCK_D)
        pm = hm[:, None] & ((p >= 2 * HALF) & (p < D))[None, :]
        tl.store(ob + p[None, :], tl.load(xb + p[None, :], mask=pm, other=0.0), mask=pm)


def _launch(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, interleaved: bool, sign: float,
            block_h: int = 8, num_warps: int = 2) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    b, s, h, d = x.shape
    half = inv_freq.numel()
    out = torch.empty((b, s, h, d), dtype=x.dtype, device=x.device)
    pos = positions if positions.dim() == 2 else positions[None]
    spb = pos.stride(0) if pos.shape[0] > 1 else 0
    block_h = min(block_h, triton.next_power_of_2(h))
    if b * s:
        _rope[(b * s, triton.cdiv(h, block_h))](
            x, out, pos, inv_freq, x.stride(0), x.stride(1), x.stride(2), out.stride(0), out.stride(1), out.stride(2), spb, pos.stride(1),
            s, h, d, half, SIGN=sign, INTERLEAVED=interleaved, HAS_PASS=2 * half < d, BLOCK_H=block_h,
            BLOCK_HALF=triton.next_power_of_2(half), BLOCK_D=triton.next_power_of_2(d), num_warps=num_warps,
        )
    return out


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, positions, inv_freq, interleaved):
        ctx.save_for_backward(positions, inv_freq)
        ctx.interleaved = interleaved
        return _launch(x, positions, inv_freq, interleaved, 1.0)

    @staticmethod
    def backward(ctx, dy):
        positions, inv_freq = ctx.saved_tensors
        return _launch(dy, positions, inv_freq, ctx.interleaved, -1.0), None, None, None


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    if x.dtype not in KERNEL_DTYPES or x.dim() != 4 or 2 * inv_freq.numel() > x.shape[-1]:
        return reference.rope(x, positions, inv_freq, interleaved)
    inv = inv_freq.to(device=x.device, dtype=torch.float32).contiguous()
    pos = positions.to(x.device)
    if pos.dim() == 2 and pos.shape[0] not in (1, x.shape[0]):
        raise ValueError(f"positions of shape {tuple(pos.shape)} do not fit x of shape {tuple(x.shape)}")
    return _Rope.apply(x, pos, inv, interleaved)
