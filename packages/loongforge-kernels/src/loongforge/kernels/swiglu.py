"""SwiGLU forward/backward in Triton on [..., 2F] inputs laid out [gate | up].

Rounds where the reference does (silu(gate) to the input dtype, then the product); the backward
computes both halves of the gradient from one read of gate, up and the output gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from loongforge.core.ops import reference
from loongforge.kernels._util import KERNEL_DTYPES

BLOCK = 1024


@triton.jit
def _swiglu_fwd(GU, OUT, stride_gu, stride_o, F, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    g = tl.load(GU + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_gu + F + cols, mask=mask, other=0.0).to(tl.float32)
    s = (g * tl.sigmoid(g)).to(GU.dtype.element_ty).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, (s * u).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(GU, DOUT, DGU, stride_gu, stride_do, stride_dgu, F, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    g = tl.load(GU + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_gu + F + cols, mask=mask, other=0.0).to(tl.float32)
    d = tl.load(DOUT + row * stride_do + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    dg = d * u * sig * (1.0 + g * (1.0 - sig))
    du = d * silu.to(GU.dtype.element_ty).to(tl.float32)
    tl.store(DGU + row * stride_dgu + cols, dg.to(DGU.dtype.element_ty), mask=mask)
    tl.store(DGU + row * stride_dgu + F + cols, du.to(DGU.dtype.element_ty), mask=mask)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up):
        two_f = gate_up.shape[-1]
        f = two_f // 2
        gu = gate_up.reshape(-1, two_f)
        if gu.stride(-1) != 1:
            gu = gu.contiguous()
        out = torch.empty((gu.shape[0], f), dtype=gate_up.dtype, device=gate_up.device)
        if gu.shape[0]:
            _swiglu_fwd[(gu.shape[0], triton.cdiv(f, BLOCK))](gu, out, gu.stride(0), out.stride(0), f, BLOCK=BLOCK, num_warps=4)
        ctx.save_for_backward(gu)
        ctx.shape = gate_up.shape
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
            _swiglu_bwd[(gu.shape[0], triton.cdiv(f, BLOCK))](
                gu, d, dgu, gu.stride(0), d.stride(0), dgu.stride(0), f, BLOCK=BLOCK, num_warps=4
            )
        return dgu.view(ctx.shape)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    if gate_up.dtype not in KERNEL_DTYPES or gate_up.shape[-1] % 2:
        return reference.swiglu(gate_up)
    return _SwiGLU.apply(gate_up)
