"""MoE token permute/unpermute in Triton: gather each token's k copies into expert order, and
combine the expert outputs back per token, weighted by the router probabilities.

Both directions are gathers (no atomics): `_gather` writes out[i] = x[src[i]],
`_combine` writes out[t] = sum_j w[t, j] * x[pos[t, j]]. Permute's backward is a combine with
unit weights; unpermute's (`_gather_dot`) gathers the probability-weighted incoming gradient and,
in the same pass over the rows, takes the router-probability gradient (each permuted row's dot
product with its token's incoming gradient: no [n*k, hidden] fp32 temporaries).
The expert order itself is torch's stable sort of the expert ids.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loongforge.core.ops import reference
from loongforge.kernels._util import KERNEL_DTYPES

BLOCK_H = 1024


@triton.jit
def _gather(X, SRC, OUT, H, DIV, BLOCK_H: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    src = tl.load(SRC + i).to(tl.int64) // DIV
    for start in range(0, H, BLOCK_H):
        c = start + tl.arange(0, BLOCK_H)
        tl.store(OUT + i * H + c, tl.load(X + src * H + c, mask=c < H, other=0.0), mask=c < H)


@triton.jit
def _gather_dot(X, SRC, W, OUT, Y, DW, H, DIV, BLOCK_H: tl.constexpr):
    """out[i] = w[src[i]] * x[src[i] // DIV] and dw[src[i]] = <y[i], x[src[i] // DIV]> (fp32)."""
    i = tl.program_id(0).to(tl.int64)
    src_flat = tl.load(SRC + i).to(tl.int64)
    src = src_flat // DIV
    scale = tl.load(W + src_flat).to(tl.float32)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for start in range(0, H, BLOCK_H):
        c = start + tl.arange(0, BLOCK_H)
        x = tl.load(X + src * H + c, mask=c < H, other=0.0).to(tl.float32)
        y = tl.load(Y + i * H + c, mask=c < H, other=0.0).to(tl.float32)
        tl.store(OUT + i * H + c, (x * scale).to(OUT.dtype.element_ty), mask=c < H)
        acc += x * y
    tl.store(DW + src_flat, tl.sum(acc, axis=0))


@triton.jit
def _combine(X, POS, W, OUT, H, K, HAS_W: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    for start in range(0, H, BLOCK_H):
        c = start + tl.arange(0, BLOCK_H)
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in range(0, K):
            row = tl.load(POS + t * K + j).to(tl.int64)
            scale = tl.load(W + t * K + j).to(tl.float32) if HAS_W else 1.0
            acc += scale * tl.load(X + row * H + c, mask=c < H, other=0.0).to(tl.float32)
        tl.store(OUT + t * H + c, acc.to(OUT.dtype.element_ty), mask=c < H)


def _gather_rows(x, src, div):
    out = torch.empty((src.numel(), x.shape[1]), dtype=x.dtype, device=x.device)
    if src.numel():
        _gather[(src.numel(),)](x, src, out, x.shape[1], div, BLOCK_H=BLOCK_H)
    return out


def _combine_rows(x, pos, k, weights=None):
    n = pos.numel() // k
    out = torch.empty((n, x.shape[1]), dtype=x.dtype, device=x.device)
    if n:
        _combine[(n,)](x, pos, weights if weights is not None else pos, out, x.shape[1], k, HAS_W=weights is not None, BLOCK_H=BLOCK_H)
    return out


def _positions(row_ids: torch.Tensor) -> torch.Tensor:
    pos = torch.empty_like(row_ids)
    pos[row_ids] = torch.arange(row_ids.numel(), device=row_ids.device)
    return pos


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, row_ids, k):
        ctx.save_for_backward(row_ids)
        ctx.k = k
        return _gather_rows(tokens.contiguous(), row_ids, k)

    @staticmethod
    def backward(ctx, dout):
        (row_ids,) = ctx.saved_tensors
        return _combine_rows(dout.contiguous(), _positions(row_ids), ctx.k), None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, permuted, row_ids, probs):
        permuted = permuted.contiguous()
        p = probs.float().contiguous().reshape(-1)
        ctx.save_for_backward(permuted, row_ids, p)
        ctx.k = probs.shape[1]
        return _combine_rows(permuted, _positions(row_ids), ctx.k, p)

    @staticmethod
    def backward(ctx, dout):
        permuted, row_ids, p = ctx.saved_tensors
        dout = dout.contiguous()
        n, h = dout.shape
        dperm = torch.empty_like(permuted)
        dprobs = torch.empty(n * ctx.k, dtype=torch.float32, device=dout.device)
        if row_ids.numel():
            _gather_dot[(row_ids.numel(),)](dout, row_ids, p, dperm, permuted, dprobs, h, ctx.k, BLOCK_H=BLOCK_H)
        return dperm, None, dprobs.view(n, ctx.k)


def moe_permute(tokens: torch.Tensor, expert_ids: torch.Tensor, num_experts: int):
    if tokens.dtype not in KERNEL_DTYPES or tokens.dim() != 2:
        return reference.moe_permute(tokens, expert_ids, num_experts)
    k = expert_ids.shape[1]
    flat = expert_ids.reshape(-1)
    row_ids = torch.sort(flat, stable=True).indices
    return _Permute.apply(tokens, row_ids, k), row_ids, torch.bincount(flat, minlength=num_experts)


def moe_unpermute(permuted: torch.Tensor, row_ids: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    if permuted.dtype not in KERNEL_DTYPES or permuted.dim() != 2:
        return reference.moe_unpermute(permuted, row_ids, probs)
    return _Unpermute.apply(permuted, row_ids, probs)
