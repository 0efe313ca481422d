"""AdamW with one Triton launch per large tensor.

torch's fused AdamW (a multi-tensor kernel) runs at about 55% of copy bandwidth on an H200 for
the bf16 parameters of a 1.3B model. Here every tensor of at least MIN_NUMEL elements gets its own
launch with its own addresses as arguments, so Triton knows they are 16-byte aligned and issues
vector loads (a pointer table read on the device, tried in run 10, gave scalar loads and 13% of
copy). Smaller tensors (norm weights, biases), where a launch would cost more than the update, go
to torch's fused kernel together. The math is AdamW's (decoupled weight decay, gradients divided
by `grad_scale` as they are read, bias corrections from each tensor's step count on the device)
in fp32 whatever the storage dtype, with the hyperparameters rounded once from their exact values
as torch's for-loop, foreach and CPU fused implementations do. (torch's CUDA fused kernel rounds
the betas to fp32 first, so its second moment sits up to 110 fp32 eps below the exact one; the
tests compare both with the exact float64 update.)
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from loongforge.core.ops import reference

BLOCK = 1024  # with NUM_WARPS the fastest of run 11's sweep (93% of copy over the 1.3B model's tensors)
NUM_WARPS = 4
MIN_NUMEL = 1 << 16
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _adamw_tensor(
    P,
    G,
    M,
    V,
    COEF,
    SCALE,
    FOUND_INF,
    n,
    lr_wd,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    eps,
    HAS_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if HAS_FOUND_INF:  # a skipped step reads and writes nothing
        n = tl.where(tl.load(FOUND_INF) == 0, n, 0)
    mask = offs < n
    step_size = tl.load(COEF)  # lr / (1 - beta1**step)
    bc2_sqrt = tl.load(COEF + 1)  # sqrt(1 - beta2**step)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        g = tl.div_rn(g, tl.load(SCALE).to(tl.float32))
    p = tl.load(P + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(M + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(V + offs, mask=mask, other=0.0).to(tl.float32)
    p = p - lr_wd * p
    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * g * g
    # IEEE-rounded sqrt and division as torch's kernel has them (Triton's defaults are approximate)
    p = p - tl.div_rn(step_size * m, tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps)
    tl.store(P + offs, p.to(P.dtype.element_ty), mask=mask)
    tl.store(M + offs, m.to(M.dtype.element_ty), mask=mask)
    tl.store(V + offs, v.to(V.dtype.element_ty), mask=mask)


def coefficients(steps: list, lr: float, beta1: float, beta2: float) -> torch.Tensor:
    """[n, 2] fp32 on the device: each tensor's step size lr / (1 - beta1**step) and
    sqrt(1 - beta2**step), from its step count on the device (never read on the host), in fp64
    from the exact betas and rounded once."""
    step = torch.stack(steps).double()
    return torch.stack([lr / (1 - beta1**step), (1 - beta2**step).sqrt()], dim=1).float()


def _own_launch(p, g, m, v) -> bool:
    return (
        p.numel() >= MIN_NUMEL
        and p.dtype in _DTYPES
        and g.dtype in _DTYPES
        and m.dtype == v.dtype
        and m.dtype in _DTYPES
        and all(t.is_contiguous() for t in (p, g, m, v))
    )


def adamw(
    params: list,
    grads: list,
    exp_avgs: list,
    exp_avg_sqs: list,
    steps: list,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
    grad_scale: Optional[torch.Tensor] = None,
    found_inf: Optional[torch.Tensor] = None,
    block: int = BLOCK,
    num_warps: int = NUM_WARPS,
) -> None:
    """The op-table `adamw` (core's reference has its contract); `block` and `num_warps` are the
    own launches' parameters, exposed for the benchmark's sweep."""
    own, rest = [], []
    for i, t in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        (own if _own_launch(*t) else rest).append(i)
    if own:
        coef = coefficients([steps[i] for i in own], lr, beta1, beta2)
        scale = grad_scale if grad_scale is not None else coef  # any pointer when HAS_SCALE is off
        skip = found_inf if found_inf is not None else coef  # likewise for HAS_FOUND_INF
        for row, i in enumerate(own):
            n = params[i].numel()
            # Triton's float scalars are fp32, so 1 - beta is formed here in double and rounded
            # once: 1 - fp32(0.999) would be 1.3e-5 (110 fp32 eps) below 0.001.
            _adamw_tensor[(triton.cdiv(n, block),)](
                params[i],
                grads[i],
                exp_avgs[i],
                exp_avg_sqs[i],
                coef[row],
                scale,
                skip,
                n,
                lr * weight_decay,
                beta1,
                1.0 - beta1,
                beta2,
                1.0 - beta2,
                eps,
                HAS_SCALE=grad_scale is not None,
                HAS_FOUND_INF=found_inf is not None,
                BLOCK=block,
                num_warps=num_warps,
            )
    if rest:
        reference.adamw(
            *([lst[i] for i in rest] for lst in (params, grads, exp_avgs, exp_avg_sqs, steps)),
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=weight_decay,
            eps=eps,
            grad_scale=grad_scale,
            found_inf=found_inf,
        )
