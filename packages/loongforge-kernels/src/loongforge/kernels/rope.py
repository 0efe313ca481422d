"""Rotary embedding forward/backward in Triton: half-split or interleaved pairs, partial rotary
(the channels past the rotary dimension are copied), any inverse frequencies (llama3 / linear
scaling are computed into them), per-token position ids (packed sequences restart them).

Queries and keys are rotated in one launch: one program rotates a block of 16 q heads and the same
block of k heads (where the token has them) of one token, with 2 warps; angles are computed once,
in fp32, from the position and the inverse frequency, after every load is issued. Programs run
head block by head block of a token, then the next token, so the programs in flight read and write
adjacent memory. The backward is the rotation by the negative angle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from loongforge.core.ops import reference
from loongforge.kernels._util import KERNEL_DTYPES

BLOCK_H, WARPS = 16, 2  # q (and k) heads per program, warps per program: see `_launch`


@triton.jit
def pair_channels(HALF, INTERLEAVED: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """The two channels each rotated pair takes (half-split or interleaved) and the mask of real
    pairs."""
    i = tl.arange(0, BLOCK_HALF)
    if INTERLEAVED:
        return 2 * i, 2 * i + 1, i < HALF
    return i, i + HALF, i < HALF


@triton.jit
def token_angles(POS, INV, HALF, BLOCK_HALF: tl.constexpr):
    """cos and sin of one token's position x the inverse frequencies, in fp32."""
    i = tl.arange(0, BLOCK_HALF)
    ang = tl.load(POS).to(tl.float32) * tl.load(INV + i, mask=i < HALF, other=0.0).to(tl.float32)
    return tl.cos(ang), tl.sin(ang)


@triton.jit
def _load_pairs(xb, h, H, sxh, c1, c2, im):
    """Both channels of every pair of heads `h` (those >= H masked) of one token, in fp32."""
    m = (h < H)[:, None] & im[None, :]
    xb = xb + h[:, None].to(tl.int64) * sxh
    x1 = tl.load(xb + c1[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(xb + c2[None, :], mask=m, other=0.0).to(tl.float32)
    return x1, x2


@triton.jit
def _store_rotated(ob, h, H, soh, c1, c2, im, x1, x2, cos, sin):
    m = (h < H)[:, None] & im[None, :]
    ob = ob + h[:, None].to(tl.int64) * soh
    tl.store(ob + c1[None, :], (x1 * cos - x2 * sin).to(ob.dtype.element_ty), mask=m)
    tl.store(ob + c2[None, :], (x2 * cos + x1 * sin).to(ob.dtype.element_ty), mask=m)


@triton.jit
def _copy_unrotated(xb, ob, h, H, sxh, soh, D, HALF, BLOCK_D: tl.constexpr):
    """Partial rotary: the channels past the rotary dimension are copied."""
    p = tl.arange(0, BLOCK_D)
    m = (h < H)[:, None] & ((p >= 2 * HALF) & (p < D))[None, :]
    x = tl.load(xb + h[:, None].to(tl.int64) * sxh + p[None, :], mask=m, other=0.0)
    tl.store(ob + h[:, None].to(tl.int64) * soh + p[None, :], x, mask=m)


@triton.jit
def _rope(
    Q,
    K,
    QO,
    KO,
    POS,
    INV,
    sqb,
    sqs,
    sqh,
    skb,
    sks,
    skh,
    sob,
    sos,
    skob,
    skos,
    spb,
    sps,
    S,
    HQ,
    HK,
    D,
    HALF,
    NBLOCKS,
    SIGN: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_PASS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program tok * NBLOCKS + j rotates q heads and k heads [j*BLOCK_H, (j+1)*BLOCK_H) of the
    token with one cos/sin computation. Outputs are contiguous [b, s, heads, d]. Every load is
    issued before the angles are computed, so the q/k reads do not wait behind the position's."""
    pid = tl.program_id(0)
    tok = pid // NBLOCKS
    b = (tok // S).to(tl.int64)
    s = (tok % S).to(tl.int64)
    h = (pid % NBLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    c1, c2, im = pair_channels(HALF, INTERLEAVED, BLOCK_HALF)
    qb, kb = Q + b * sqb + s * sqs, K + b * skb + s * sks
    qob, kob = QO + b * sob + s * sos, KO + b * skob + s * skos
    q1, q2 = _load_pairs(qb, h, HQ, sqh, c1, c2, im)
    k1, k2 = _load_pairs(kb, h, HK, skh, c1, c2, im)
    cos, sin = token_angles(POS + b * spb + s * sps, INV, HALF, BLOCK_HALF)
    cos = cos[None, :]
    sin = (sin * SIGN)[None, :]
    _store_rotated(qob, h, HQ, D, c1, c2, im, q1, q2, cos, sin)
    _store_rotated(kob, h, HK, D, c1, c2, im, k1, k2, cos, sin)
    if HAS_PASS:
        _copy_unrotated(qb, qob, h, HQ, sqh, D, D, HALF, BLOCK_D)
        _copy_unrotated(kb, kob, h, HK, skh, D, D, HALF, BLOCK_D)


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    interleaved: bool,
    sign: float,
    block_h: int = BLOCK_H,
    num_warps: int = WARPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Program j of a token rotates q heads and k heads [j*block_h, (j+1)*block_h): the k heads
    ride along in the first programs. (Giving every program an even share of k heads made the GQA
    tile [2, 64], too narrow for 16-byte accesses: 54-88% of copy against 95% for MHA, run 24.)
    16 heads and 2 warps, with loads issued before the angle arithmetic, was the fastest at every
    benchmark shape in runs 28 and 31; L2 eviction hints on top of it were slower in run 31, by up
    to 4%. The head blocks of a token are neighbouring programs (one grid axis, blocks fastest):
    with tokens fastest, the programs in flight each took a 4 KiB piece of q rows 8 KiB apart
    (GQA, 32 heads), and the kernel was 4-5% slower at 8192 tokens (session 9, run 1)."""
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    b, s, hq, d = q.shape
    hk = k.shape[2]
    half = inv_freq.numel()
    qo = torch.empty((b, s, hq, d), dtype=q.dtype, device=q.device)
    ko = torch.empty((b, s, hk, d), dtype=k.dtype, device=k.device)
    pos = positions if positions.dim() == 2 else positions[None]
    spb = pos.stride(0) if pos.shape[0] > 1 else 0
    heads = max(hq, hk)
    block_h = min(block_h, triton.next_power_of_2(heads))
    nblocks = triton.cdiv(heads, block_h)
    if b * s:
        _rope[(b * s * nblocks,)](
            q,
            k,
            qo,
            ko,
            pos,
            inv_freq,
            q.stride(0),
            q.stride(1),
            q.stride(2),
            k.stride(0),
            k.stride(1),
            k.stride(2),
            qo.stride(0),
            qo.stride(1),
            ko.stride(0),
            ko.stride(1),
            spb,
            pos.stride(1),
            s,
            hq,
            hk,
            d,
            half,
            nblocks,
            SIGN=sign,
            INTERLEAVED=interleaved,
            HAS_PASS=2 * half < d,
            BLOCK_H=block_h,
            BLOCK_HALF=triton.next_power_of_2(half),
            BLOCK_D=triton.next_power_of_2(d),
            num_warps=num_warps,
        )
    return qo, ko


class Rotation(torch.autograd.Function):
    """q and k rotated by `launch(q, k, a, b, interleaved, sign)` (a, b: what gives the angles,
    constants of the positions); the backward is the same launch on the output gradients with the
    negative angle. `rope` (positions, inverse frequencies) and `rotary` (cos / sin tables) share it."""

    @staticmethod
    def forward(ctx, launch, q, k, a, b, interleaved):
        ctx.save_for_backward(a, b)
        ctx.launch, ctx.interleaved = launch, interleaved
        return launch(q, k, a, b, interleaved, 1.0)

    @staticmethod
    def backward(ctx, dq, dk):
        a, b = ctx.saved_tensors
        return None, *ctx.launch(dq, dk, a, b, ctx.interleaved, -1.0), None, None, None


def rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, interleaved: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    if (
        q.dtype not in KERNEL_DTYPES
        or q.dtype != k.dtype
        or q.dim() != 4
        or k.shape[:2] != q.shape[:2]
        or k.shape[3] != q.shape[3]
        or 2 * inv_freq.numel() > q.shape[-1]
    ):
        return reference.rope(q, k, positions, inv_freq, interleaved)
    inv = inv_freq.to(device=q.device, dtype=torch.float32).contiguous()
    pos = positions.to(q.device)
    if pos.dim() == 2 and pos.shape[0] not in (1, q.shape[0]):
        raise ValueError(f"positions of shape {tuple(pos.shape)} do not fit q of shape {tuple(q.shape)}")
    return Rotation.apply(_launch, q, k, pos, inv, interleaved)
