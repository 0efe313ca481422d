"""AdamW over every tensor of a parameter group in one Triton launch.

torch's fused AdamW runs at about 60% of copy bandwidth on an H200 for bf16 parameters. Here each
program updates one BLOCK-element slice of one tensor: a table maps program -> (tensor, offset),
built once per set of tensor sizes, and the tensors' addresses travel as one int64 table per step
(the gradients are new tensors every step). The math is torch's fused AdamW's (fp32 arithmetic,
decoupled weight decay, bias corrections from the per-tensor step counts read on the device,
gradients divided by `grad_scale`).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from loongforge.core.ops import reference

BLOCK = 4096
_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _adamw_blocks(PTRS, T, NUMEL, PROG_T, PROG_START, SCALE, lr, beta1, beta2, eps, weight_decay,
                  HAS_SCALE: tl.constexpr, P_DT: tl.constexpr, G_DT: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(PROG_T + pid)
    start = tl.load(PROG_START + pid)
    n = tl.load(NUMEL + t)
    p_ptr = tl.load(PTRS + t).to(tl.pointer_type(P_DT))
    g_ptr = tl.load(PTRS + T + t).to(tl.pointer_type(G_DT))
    m_ptr = tl.load(PTRS + 2 * T + t).to(tl.pointer_type(P_DT))
    v_ptr = tl.load(PTRS + 3 * T + t).to(tl.pointer_type(P_DT))
    step = tl.load(tl.load(PTRS + 4 * T + t).to(tl.pointer_type(tl.float32)))
    offs = start + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        g = g / tl.load(SCALE).to(tl.float32)
    p = p - lr * weight_decay * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    bc1 = 1.0 - tl.exp(step * tl.log(beta1))
    bc2_sqrt = tl.sqrt(1.0 - tl.exp(step * tl.log(beta2)))
    p = p - (lr / bc1) * m / (tl.sqrt(v) / bc2_sqrt + eps)
    tl.store(p_ptr + offs, p.to(P_DT), mask=mask)
    tl.store(m_ptr + offs, m.to(P_DT), mask=mask)
    tl.store(v_ptr + offs, v.to(P_DT), mask=mask)


@functools.lru_cache(maxsize=16)
def _program_table(numels: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(numel per tensor, tensor index per program, first element per program) on the device."""
    blocks = torch.tensor([triton.cdiv(n, BLOCK) for n in numels])
    prog_t = torch.repeat_interleave(torch.arange(len(numels)), blocks)
    first = torch.cumsum(blocks, 0) - blocks
    prog_start = (torch.arange(len(prog_t)) - first[prog_t]) * BLOCK
    return (torch.tensor(numels, dtype=torch.int64).to(device), prog_t.to(device=device, dtype=torch.int32),
            prog_start.to(device=device, dtype=torch.int64))


def _supported(params, grads, exp_avgs) -> bool:
    p, g = params[0], grads[0]
    return (p.dtype in _TL and g.dtype in _TL and all(t.is_contiguous() for t in (*params, *grads, *exp_avgs))
            and all(x.dtype == p.dtype for x in (*params, *exp_avgs)) and all(x.dtype == g.dtype for x in grads))


def adamw(params: list, grads: list, exp_avgs: list, exp_avg_sqs: list, steps: list, *, lr: float, beta1: float, beta2: float,
          weight_decay: float, eps: float, grad_scale: Optional[torch.Tensor] = None) -> None:
    if not params:
        return
    if not _supported(params, grads, [*exp_avgs, *exp_avg_sqs]):
        return reference.adamw(params, grads, exp_avgs, exp_avg_sqs, steps, lr=lr, beta1=beta1, beta2=beta2,
                               weight_decay=weight_decay, eps=eps, grad_scale=grad_scale)
    device = params[0].device
    numel, prog_t, prog_start = _program_table(tuple(p.numel() for p in params), device)
    ptrs = torch.tensor([t.data_ptr() for group in (params, grads, exp_avgs, exp_avg_sqs, steps) for t in group], dtype=torch.int64)
    ptrs = ptrs.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else ptrs
    scale = grad_scale.to(device) if grad_scale is not None else numel
    _adamw_blocks[(prog_t.numel(),)](ptrs, len(params), numel, prog_t, prog_start, scale, lr, beta1, beta2, eps, weight_decay,
                                     HAS_SCALE=grad_scale is not None, P_DT=_TL[params[0].dtype], G_DT=_TL[grads[0].dtype],
                                     BLOCK=BLOCK, num_warps=4)
