"""Fused output projection + cross-entropy that never holds the whole [tokens, vocab] logits.

Tokens go through in chunks whose logits are at most as large as the weight (and at least
LOGITS_BUDGET bytes): every chunk re-reads and re-writes the whole weight gradient, so with a
large vocabulary small chunks cost more in that accumulation than the logits they save (fwd+bwd
at 4096 x 2048 x 151936 on an H200: 15.0 ms with 128 MiB chunks, 12.2 ms with the weight's size).
For each
chunk: logits = h @ W^T (cuBLAS), then one Triton program per row makes two passes over the row
(online max / sum-exp, then softmax minus one-hot, times the token's weight, written over the
logits in place), then grad_h = dlogits @ W and grad_W += dlogits^T @ h. The gradients are
finished in the forward (the loss is a weighted sum, so they are known there) and scaled by the
incoming gradient in the backward: three matmuls in all, as in an unfused forward + backward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from loongforge.core.ops import reference

LOGITS_BUDGET = 128 << 20  # the smallest chunk: grad_w + grad_h + one chunk of logits is all the extra memory
BLOCK_V = 16384  # with CE_WARPS the fastest of run 11's sweep on one 512 x 128256 bf16 chunk (79% of copy)
CE_WARPS = 32
SCALE_BLOCK = 4096


@triton.jit
def _ce_rows(
    LOGITS, stride_l, LABELS, WEIGHTS, LOSS, V, ignore_index, smoothing, HAS_GRAD: tl.constexpr, SMOOTH: tl.constexpr, BLOCK_V: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride_l
    label = tl.load(LABELS + row).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)
    m = tl.max(tl.full([BLOCK_V], float("-inf"), tl.float32), axis=0)
    acc = tl.sum(tl.zeros([BLOCK_V], tl.float32), axis=0)
    zsum = tl.sum(tl.zeros([BLOCK_V], tl.float32), axis=0)
    for start in range(0, V, BLOCK_V):
        c = start + cols
        z = tl.load(base + c, mask=c < V, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, tl.max(z, axis=0))
        acc = acc * tl.exp(m - new_m) + tl.sum(tl.exp(z - new_m), axis=0)
        m = new_m
        if SMOOTH:  # the row's logit sum, only for label smoothing (a third reduction per block)
            zsum += tl.sum(tl.where(c < V, z, 0.0), axis=0)
    lse = m + tl.log(acc)
    valid = label != ignore_index
    safe = tl.where(valid, label, 0)
    zy = tl.load(base + safe).to(tl.float32)
    loss = lse - zy
    if SMOOTH:
        loss = (1.0 - smoothing) * loss + smoothing * (lse - zsum / V)
    tl.store(LOSS + row, tl.where(valid, loss, 0.0))
    if HAS_GRAD:
        w = tl.where(valid, tl.load(WEIGHTS + row).to(tl.float32), 0.0)
        for start in range(0, V, BLOCK_V):
            c = start + cols
            z = tl.load(base + c, mask=c < V, other=0.0).to(tl.float32)
            if SMOOTH:
                g = tl.exp(z - lse) - smoothing / V - tl.where(c == safe, 1.0 - smoothing, 0.0)
            else:
                g = tl.exp(z - lse) - tl.where(c == safe, 1.0, 0.0)
            tl.store(base + c, (g * w).to(LOGITS.dtype.element_ty), mask=c < V)


@triton.jit
def _scale(X, S, n, BLOCK: tl.constexpr):
    s = tl.load(S)
    if s != 1.0:  # the usual incoming gradient of a loss: nothing to do, and no host sync to find that out
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(X + offs, mask=mask)
        tl.store(X + offs, (x.to(tl.float32) * s).to(X.dtype.element_ty), mask=mask)


def _scale_(x: torch.Tensor, s: torch.Tensor) -> None:
    _scale[(triton.cdiv(x.numel(), SCALE_BLOCK),)](x, s, x.numel(), BLOCK=SCALE_BLOCK, num_warps=8 if x.is_cuda else 4)


def ce_rows(logits, labels, token_weights, loss, ignore_index, smoothing, has_grad, block_v=None, num_warps=None) -> None:
    """Each row's loss into `loss`, and with `has_grad` its logit gradient over the row in place
    (exposed with its launch parameters for the benchmark's sweep)."""
    _ce_rows[(logits.shape[0],)](
        logits,
        logits.stride(0),
        labels,
        token_weights,
        loss,
        logits.shape[1],
        ignore_index,
        smoothing,
        HAS_GRAD=has_grad,
        SMOOTH=smoothing != 0.0,
        BLOCK_V=block_v or BLOCK_V,
        num_warps=(num_warps or CE_WARPS) if logits.is_cuda else 4,
    )


def _compute_dtype(h: torch.Tensor) -> torch.dtype:
    if h.is_cuda and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return h.dtype


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, token_weights, ignore_index, smoothing, grad_enabled, logits_budget):
        dt = _compute_dtype(hidden)
        h = hidden.to(dt)
        w = weight.to(dt)
        n, v = h.shape[0], w.shape[0]
        want_h, want_w = grad_enabled and ctx.needs_input_grad[0], grad_enabled and ctx.needs_input_grad[1]
        grads = want_h or want_w
        loss = torch.empty(n, dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h) if want_h else None
        grad_w = torch.zeros_like(weight) if want_w else None
        tw = token_weights.to(torch.float32).contiguous()
        lab = labels.contiguous()
        budget = logits_budget or max(LOGITS_BUDGET, w.numel() * w.element_size())
        chunk = max(1, min(n, budget // (v * h.element_size())))
        if chunk > 128:
            chunk -= chunk % 128  # whole matmul tiles
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            logits = h[a:b] @ w.T
            ce_rows(logits, lab[a:b], tw[a:b], loss[a:b], ignore_index, float(smoothing), grads)
            if want_h:
                torch.mm(logits, w, out=grad_h[a:b])
            if want_w:
                if grad_w.dtype == logits.dtype:
                    grad_w.addmm_(logits.T, h[a:b])
                else:  # an fp32 master weight: the chunk's product in the compute dtype, added in fp32
                    grad_w += (logits.T @ h[a:b]).to(grad_w.dtype)
            del logits
        ctx.save_for_backward(grad_h, grad_w)
        ctx.hidden_dtype = hidden.dtype
        ctx.consumed = False
        return (loss * tw).sum()

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.consumed:  # checked before unpacking: autograd's own message would blame an in-place op
            raise RuntimeError(
                "linear_cross_entropy: the fused op's gradients were already used; backward through it runs once "
                "(retain_graph is not supported)"
            )
        ctx.consumed = True
        grad_h, grad_w = ctx.saved_tensors
        # scaled in place on the device, skipped there when the incoming gradient is 1: no host
        # check of it (that would stall the GPU between forward and backward) and no second
        # [vocab, hidden] buffer
        scale = grad_out.detach().to(torch.float32).reshape(1)
        if grad_h is not None:
            _scale_(grad_h, scale)
            grad_h = grad_h.to(ctx.hidden_dtype)
        if grad_w is not None:
            _scale_(grad_w, scale)
        return grad_h, grad_w, None, None, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    token_weights: torch.Tensor,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    logits_budget: int | None = None,
) -> torch.Tensor:
    """The op-table `linear_cross_entropy` (core's reference has its contract); `logits_budget`
    (bytes of one chunk's logits; by default the weight's size, at least LOGITS_BUDGET) is exposed
    for the tests and the benchmark's sweep."""
    if hidden.dim() != 2 or weight.dim() != 2 or not hidden.is_floating_point():
        return reference.linear_cross_entropy(hidden, weight, labels, token_weights, ignore_index, label_smoothing)
    return _LinearCrossEntropy.apply(
        hidden, weight, labels, token_weights, ignore_index, label_smoothing, torch.is_grad_enabled(), logits_budget
    )
