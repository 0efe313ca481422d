"""Gated MLP activations in Triton on [..., 2F] inputs laid out [gate | up]: SwiGLU
(silu(gate) * up) and GeGLU (gelu_tanh(gate) * up, Gemma's), one kernel pair for both.

Rounds where the reference does (act(gate) to the input dtype, then the product); the backward
computes both halves of the gradient from one read of gate, up and the output gradient.
gelu_tanh(g) = g * sigmoid(2u) with u = sqrt(2/pi) * (g + 0.044715 g^3), since
0.5 * (1 + tanh(u)) = sigmoid(2u).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from loongforge.core.ops import reference
from loongforge.kernels._util import KERNEL_DTYPES

BLOCK = 1024


@triton.jit
def _act_and_slope(g, GELU: tl.constexpr):
    """(act(g), d act / d g) in fp32."""
    if GELU:
        # u = sqrt(2/pi) * (g + 0.044715 g^3); d sigmoid(2u) / dg = sig * (1 - sig) * 2u'
        sig = tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))
        inner = 1.5957691216057308 * (1.0 + 0.134145 * g * g)
    else:
        sig = tl.sigmoid(g)
        inner = tl.full(g.shape, 1.0, tl.float32)
    return g * sig, sig + g * sig * (1.0 - sig) * inner


@triton.jit
def _gated_fwd(GU, OUT, stride_gu, stride_o, F, GELU: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    g = tl.load(GU + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_gu + F + cols, mask=mask, other=0.0).to(tl.float32)
    a, _ = _act_and_slope(g, GELU)
    s = a.to(GU.dtype.element_ty).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, (s * u).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _gated_bwd(GU, DOUT, DGU, stride_gu, stride_do, stride_dgu, F, GELU: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    g = tl.load(GU + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_gu + F + cols, mask=mask, other=0.0).to(tl.float32)
    d = tl.load(DOUT + row * stride_do + cols, mask=mask, other=0.0).to(tl.float32)
    a, slope = _act_and_slope(g, GELU)
    dg = d * u * slope
    du = d * a.to(GU.dtype.element_ty).to(tl.float32)
    tl.store(DGU + row * stride_dgu + cols, dg.to(DGU.dtype.element_ty), mask=mask)
    tl.store(DGU + row * stride_dgu + F + cols, du.to(DGU.dtype.element_ty), mask=mask)


class _Gated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up, gelu):
        two_f = gate_up.shape[-1]
        f = two_f // 2
        gu = gate_up.reshape(-1, two_f)
        if gu.stride(-1) != 1:
            gu = gu.contiguous()
        out = torch.empty((gu.shape[0], f), dtype=gate_up.dtype, device=gate_up.device)
        if gu.shape[0]:
            _gated_fwd[(gu.shape[0], triton.cdiv(f, BLOCK))](gu, out, gu.stride(0), out.stride(0), f, GELU=gelu, BLOCK=BLOCK, num_warps=4)
        ctx.save_for_backward(gu)
        ctx.shape, ctx.gelu = gate_up.shape, gelu
        return out.view(*gate_up.shape[:-1], f)

    @staticmethod
    def backward(ctx, dout):
        (gu,) = ctx.saved_tensors
        f = gu.shape[1] // 2
        d = dout.reshape(-1, f)
        if d.stride(-1) != 1:
            d = d.contiguous()
        dgu = torch.empty_like(gu)
        if gu.shape[0]:
            _gated_bwd[(gu.shape[0], triton.cdiv(f, BLOCK))](
                gu, d, dgu, gu.stride(0), d.stride(0), dgu.stride(0), f, GELU=ctx.gelu, BLOCK=BLOCK, num_warps=4
            )
        return dgu.view(ctx.shape), None


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    if gate_up.dtype not in KERNEL_DTYPES or gate_up.shape[-1] % 2:
        return reference.swiglu(gate_up)
    return _Gated.apply(gate_up, False)


def geglu(gate_up: torch.Tensor) -> torch.Tensor:
    if gate_up.dtype not in KERNEL_DTYPES or gate_up.shape[-1] % 2:
        return reference.geglu(gate_up)
    return _Gated.apply(gate_up, True)
