"""megatron's fused q/k/v projection split into q, k and v with the rotary embedding on q and k,
in one Triton kernel each way.

Unfused, the split leaves strided views of the projection, RoPE rewrites q and k, attention
copies v, and the split's backward concatenates the three gradients (a `torch.cat` over the
whole projection per layer). Here the forward reads the projection once and writes q, k, v
once; the backward reads their gradients once and writes the projection's gradient in one piece.

Each program takes one token and a block of its head slots: slot j of group g is
`[q_1 .. q_r | k | v][j]`, so q, k and v heads are rotated by the same code (v with the identity
rotation) and stored through three disjoint masks. Angles are computed in fp32 from the position
and the inverse frequency, once per token, after the loads are issued. The slot blocks of a token
are neighbouring programs, as in `rope`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from loongforge.core.ops import reference
from loongforge.kernels._util import KERNEL_DTYPES
from loongforge.kernels.rope import pair_channels, token_angles


@triton.jit
def _qkv_rope(
    M,
    Q,
    K,
    V,
    POS,
    INV,
    sms,
    smb,
    smg,
    sqs,
    sqb,
    sqh,
    sks,
    skb,
    skh,
    svs,
    svb,
    svh,
    spb,
    sps,
    B,
    G,
    R,
    D,
    HALF,
    NBLOCKS,
    SIGN: tl.constexpr,
    BACKWARD: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_PASS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program tok * NBLOCKS + j takes slots [j*BLOCK_H, (j+1)*BLOCK_H) of token tok (s-major).
    Every load is issued before the angles are computed."""
    pid = tl.program_id(0)
    tok = pid // NBLOCKS
    s = (tok // B).to(tl.int64)
    b = (tok % B).to(tl.int64)
    slot = (pid % NBLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    g = slot // (R + 2)
    r = slot % (R + 2)
    valid = g < G
    is_q = valid & (r < R)
    is_k = valid & (r == R)
    is_v = valid & (r == R + 1)

    c1, c2, im = pair_channels(HALF, INTERLEAVED, BLOCK_HALF)
    m_off = s * sms + b * smb + g.to(tl.int64)[:, None] * smg + (r * D)[:, None]
    q_off = s * sqs + b * sqb + (g * R + r).to(tl.int64)[:, None] * sqh
    k_off = s * sks + b * skb + g.to(tl.int64)[:, None] * skh
    v_off = s * svs + b * svb + g.to(tl.int64)[:, None] * svh
    mq = is_q[:, None] & im[None, :]
    mk = is_k[:, None] & im[None, :]
    mv = is_v[:, None] & im[None, :]
    mm = valid[:, None] & im[None, :]

    if BACKWARD:
        x1 = (
            tl.load(Q + q_off + c1[None, :], mask=mq, other=0.0).to(tl.float32)
            + tl.load(K + k_off + c1[None, :], mask=mk, other=0.0).to(tl.float32)
            + tl.load(V + v_off + c1[None, :], mask=mv, other=0.0).to(tl.float32)
        )
        x2 = (
            tl.load(Q + q_off + c2[None, :], mask=mq, other=0.0).to(tl.float32)
            + tl.load(K + k_off + c2[None, :], mask=mk, other=0.0).to(tl.float32)
            + tl.load(V + v_off + c2[None, :], mask=mv, other=0.0).to(tl.float32)
        )
    else:
        x1 = tl.load(M + m_off + c1[None, :], mask=mm, other=0.0).to(tl.float32)
        x2 = tl.load(M + m_off + c2[None, :], mask=mm, other=0.0).to(tl.float32)
    cos, sin = token_angles(POS + b * spb + s * sps, INV, HALF, BLOCK_HALF)
    cos = tl.where(is_v[:, None], 1.0, cos[None, :])  # v: the identity rotation
    sin = tl.where(is_v[:, None], 0.0, sin[None, :] * SIGN)
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin

    if BACKWARD:
        tl.store(M + m_off + c1[None, :], y1.to(M.dtype.element_ty), mask=mm)
        tl.store(M + m_off + c2[None, :], y2.to(M.dtype.element_ty), mask=mm)
        if HAS_PASS:
            p = tl.arange(0, BLOCK_D)
            pc = ((p >= 2 * HALF) & (p < D))[None, :]
            xp = (
                tl.load(Q + q_off + p[None, :], mask=is_q[:, None] & pc, other=0.0)
                + tl.load(K + k_off + p[None, :], mask=is_k[:, None] & pc, other=0.0)
                + tl.load(V + v_off + p[None, :], mask=is_v[:, None] & pc, other=0.0)
            )
            tl.store(M + m_off + p[None, :], xp, mask=valid[:, None] & pc)
    else:
        y1 = y1.to(Q.dtype.element_ty)
        y2 = y2.to(Q.dtype.element_ty)
        tl.store(Q + q_off + c1[None, :], y1, mask=mq)
        tl.store(Q + q_off + c2[None, :], y2, mask=mq)
        tl.store(K + k_off + c1[None, :], y1, mask=mk)
        tl.store(K + k_off + c2[None, :], y2, mask=mk)
        tl.store(V + v_off + c1[None, :], y1, mask=mv)
        tl.store(V + v_off + c2[None, :], y2, mask=mv)
        if HAS_PASS:
            p = tl.arange(0, BLOCK_D)
            pc = ((p >= 2 * HALF) & (p < D))[None, :]
            xp = tl.load(M + m_off + p[None, :], mask=valid[:, None] & pc, other=0.0)
            tl.store(Q + q_off + p[None, :], xp, mask=is_q[:, None] & pc)
            tl.store(K + k_off + p[None, :], xp, mask=is_k[:, None] & pc)
            tl.store(V + v_off + p[None, :], xp, mask=is_v[:, None] & pc)


def _empty_heads(s: int, b: int, h: int, d: int, like: torch.Tensor) -> torch.Tensor:
    """q, k or v in megatron's [seq, batch] order (batch-major measured the same through attention)."""
    return torch.empty((s, b, h, d), dtype=like.dtype, device=like.device)


def _launch(mixed, q, k, v, pos, inv, r, interleaved, backward, block_h=16, num_warps=2):
    """16 slots per program: 4-12% faster than 8 at the benchmark shapes (session 9, run 2)."""
    s, b, g, width = mixed.shape
    d = width // (r + 2)
    half = inv.numel()
    spb = pos.stride(0) if pos.shape[0] > 1 else 0
    slots = g * (r + 2)
    block_h = min(block_h, triton.next_power_of_2(slots))
    nblocks = triton.cdiv(slots, block_h)
    if s * b:
        _qkv_rope[(s * b * nblocks,)](
            mixed,
            q,
            k,
            v,
            pos,
            inv,
            mixed.stride(0),
            mixed.stride(1),
            mixed.stride(2),
            q.stride(0),
            q.stride(1),
            q.stride(2),
            k.stride(0),
            k.stride(1),
            k.stride(2),
            v.stride(0),
            v.stride(1),
            v.stride(2),
            spb,
            pos.stride(1),
            b,
            g,
            r,
            d,
            half,
            nblocks,
            SIGN=-1.0 if backward else 1.0,
            BACKWARD=backward,
            INTERLEAVED=interleaved,
            HAS_PASS=2 * half < d,
            BLOCK_H=block_h,
            BLOCK_HALF=triton.next_power_of_2(half),
            BLOCK_D=triton.next_power_of_2(d),
            num_warps=num_warps,
        )


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


class _QKVRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mixed, positions, inv_freq, r, interleaved):
        s, b, g, width = mixed.shape
        d = width // (r + 2)
        q, k, v = _empty_heads(s, b, g * r, d, mixed), _empty_heads(s, b, g, d, mixed), _empty_heads(s, b, g, d, mixed)
        _launch(mixed, q, k, v, positions, inv_freq, r, interleaved, backward=False)
        ctx.save_for_backward(positions, inv_freq)
        ctx.shape, ctx.r, ctx.interleaved = mixed.shape, r, interleaved
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        positions, inv_freq = ctx.saved_tensors
        dmixed = torch.empty(ctx.shape, dtype=dq.dtype, device=dq.device)
        _launch(
            dmixed,
            _last_dim_contiguous(dq),
            _last_dim_contiguous(dk),
            _last_dim_contiguous(dv),
            positions,
            inv_freq,
            ctx.r,
            ctx.interleaved,
            backward=True,
        )
        return dmixed, None, None, None, None


def qkv_rope(
    mixed: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, q_per_group: int, interleaved: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    s, b, g, width = mixed.shape
    if mixed.dtype not in KERNEL_DTYPES or width % (q_per_group + 2) or 2 * inv_freq.numel() > width // (q_per_group + 2):
        return reference.qkv_rope(mixed, positions, inv_freq, q_per_group, interleaved)
    pos = positions.to(mixed.device)
    pos = pos if pos.dim() == 2 else pos[None]
    if pos.shape[0] not in (1, b) or pos.shape[1] != s:
        raise ValueError(f"positions of shape {tuple(positions.shape)} do not fit a projection of shape {tuple(mixed.shape)}")
    inv = inv_freq.to(device=mixed.device, dtype=torch.float32).contiguous()
    return _QKVRope.apply(_last_dim_contiguous(mixed), pos, inv, q_per_group, interleaved)
