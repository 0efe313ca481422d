"""RMSNorm forward/backward in Triton, with an optional fused residual add, and Gemma's variant.

Matches core's reference exactly in its rounding points: the normalized row is cast to the
input dtype before the weight multiplies it, and the output dtype is that of `x * weight` under
torch's promotion (fp32 when an fp32 master weight meets bf16 activations). Gemma's (`GEMMA`):
rms(x) * (1 + weight) without the intermediate cast, output in the input dtype. The backward
keeps everything in fp32 until the final store; the weight gradient is summed per program, then
over programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from loongforge.core.ops import reference
from loongforge.kernels._util import KERNEL_DTYPES, programs_for

MAX_HIDDEN = 65536


@triton.jit
def _rms_norm_fwd(
    X,
    R,
    W,
    Y,
    S,
    RSTD,
    stride_x,
    stride_r,
    stride_y,
    stride_s,
    M,
    N,
    eps,
    HAS_RES: tl.constexpr,
    GEMMA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK)
    rmask = rows < M
    mask = rmask[:, None] & (cols < N)[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RES:
        x = x + tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        tl.store(S + rows[:, None] * stride_s + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / N + eps)
    tl.store(RSTD + rows, rstd, mask=rmask)
    xn = xf * rstd[:, None]
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    if GEMMA:
        w = w + 1.0
    else:
        xn = xn.to(X.dtype.element_ty).to(tl.float32)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], (w[None, :] * xn).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd(
    DY,
    X,
    W,
    RSTD,
    DX,
    DS,
    DW,
    stride_dy,
    stride_x,
    stride_dx,
    stride_ds,
    M,
    N,
    rows_per_program,
    HAS_DS: tl.constexpr,
    GEMMA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    cmask = cols < N
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    if GEMMA:
        w = w + 1.0
    dw = tl.zeros([BLOCK_M, BLOCK], dtype=tl.float32)
    start = pid * rows_per_program
    end = tl.minimum(start + rows_per_program, M)
    for r in range(start, end, BLOCK_M):
        rows = tl.cast(r, tl.int64) + tl.arange(0, BLOCK_M)
        rmask = rows < end
        mask = rmask[:, None] & cmask[None, :]
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        xr = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
        xhat = xr.to(tl.float32) * rstd[:, None]
        if GEMMA:
            dw += dy * xhat
        else:
            dw += dy * xhat.to(X.dtype.element_ty).to(tl.float32)
        g = dy * w[None, :]
        dx = rstd[:, None] * (g - xhat * (tl.sum(g * xhat, axis=1) / N)[:, None])
        if HAS_DS:
            dx += tl.load(DS + rows[:, None] * stride_ds + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DW + pid * N + cols, tl.sum(dw, axis=0), mask=cmask)


def launch_config(n: int) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """Forward (rows per block, warps) and backward (rows per block, warps, programs per SM) for
    hidden size n: the fastest of a sweep on one H200 (bf16, 8192 and 32768 rows; run 8 in
    docs/benchmarks.md). Few backward programs keep the fp32 weight-gradient partials small."""
    block = triton.next_power_of_2(n)
    if block <= 2048:
        return (max(1, 2048 // block), 4), (max(4, 4096 // block), 4, 2)
    if block == 4096:
        return (2, 16), (4, 16, 1)
    if block == 8192:
        return (2, 4), (2, 16, 1)
    return (1, 16), (1, 16, 1)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    t = t.reshape(-1, n)
    return t if t.stride(-1) == 1 else t.contiguous()


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, residual, gemma=False):
        n = x.shape[-1]
        x2 = _rows(x, n)
        r2 = _rows(residual, n) if residual is not None else None
        m = x2.shape[0]
        y = torch.empty((m, n), dtype=x.dtype if gemma else torch.promote_types(x.dtype, weight.dtype), device=x.device)
        s = torch.empty_like(x2) if residual is not None else None
        rstd = torch.empty(m, dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(n)
        (block_m, warps), _ = launch_config(n)
        if m:
            _rms_norm_fwd[(triton.cdiv(m, block_m),)](
                x2,
                r2 if r2 is not None else x2,
                weight,
                y,
                s if s is not None else x2,
                rstd,
                x2.stride(0),
                r2.stride(0) if r2 is not None else 0,
                y.stride(0),
                s.stride(0) if s is not None else 0,
                m,
                n,
                eps,
                HAS_RES=residual is not None,
                GEMMA=gemma,
                BLOCK_M=block_m,
                BLOCK=block,
                num_warps=warps,
            )
        ctx.save_for_backward(s if s is not None else x2, weight, rstd)
        ctx.shape, ctx.has_res, ctx.gemma = x.shape, residual is not None, gemma
        y = y.view(*x.shape[:-1], n)
        return (y, s.view(x.shape)) if residual is not None else y

    @staticmethod
    def backward(ctx, dy, ds=None):
        x2, weight, rstd = ctx.saved_tensors
        m, n = x2.shape
        dy2 = _rows(dy, n)
        ds2 = _rows(ds, n) if ds is not None else None
        dx = torch.empty_like(x2)
        block = triton.next_power_of_2(n)
        _, (block_m, warps, per_sm) = launch_config(n)
        progs = programs_for(x2.device, triton.cdiv(m, block_m), per_sm)
        dw_part = torch.empty((progs, n), dtype=torch.float32, device=x2.device)
        if m:
            _rms_norm_bwd[(progs,)](
                dy2,
                x2,
                weight,
                rstd,
                dx,
                ds2 if ds2 is not None else dy2,
                dw_part,
                dy2.stride(0),
                x2.stride(0),
                dx.stride(0),
                ds2.stride(0) if ds2 is not None else 0,
                m,
                n,
                triton.cdiv(triton.cdiv(m, progs), block_m) * block_m,
                HAS_DS=ds2 is not None,
                GEMMA=ctx.gemma,
                BLOCK_M=block_m,
                BLOCK=block,
                num_warps=warps,
            )
        dw = dw_part.sum(0).to(weight.dtype) if m else torch.zeros_like(weight)
        dx = dx.view(ctx.shape)
        return dx, dw, None, (dx if ctx.has_res else None), None


def _supported(x, weight) -> bool:
    return x.dtype in KERNEL_DTYPES and weight.dtype in KERNEL_DTYPES and x.shape[-1] <= MAX_HIDDEN and weight.is_contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not _supported(x, weight):
        return reference.rms_norm(x, weight, eps)
    return _RMSNorm.apply(x, weight, eps, None)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if not _supported(x, weight) or residual.dtype != x.dtype or residual.shape != x.shape:
        return reference.add_rms_norm(x, residual, weight, eps)
    return _RMSNorm.apply(x, weight, eps, residual)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not _supported(x, weight):
        return reference.gemma_rms_norm(x, weight, eps)
    return _RMSNorm.apply(x, weight, eps, None, True)
