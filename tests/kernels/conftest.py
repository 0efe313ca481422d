"""What the CPU and GPU kernel tests share: the AdamW comparison against torch's fused kernel."""

import math

import pytest
import torch


def _adamw_bounds(p, m, v, g, step, *, lr, beta1, beta2, eps, dtype):
    """Per-element bounds on how far an update with fp32 arithmetic may land from torch's fused
    AdamW, which forms the weight decay and the moment updates in fp64 and rounds them once.
    With u the fp32 unit roundoff (eps/2), from the state before the update (float64 here):
    - exp_avg: three fp32 roundings of the terms b1*m and (1-b1)*g and one of their sum against
      torch's one, so 2 eps of S_m = |b1*m| + |(1-b1)*g| (not of the result, which can cancel);
      bound 4 eps * S_m.
    - exp_avg_sq: the same with no cancellation, S_v = b2*v + (1-b2)*g^2; bound 4 eps * S_v.
    - param: the weight decay (1.5 eps of |p|), the exp_avg difference carried through
      step_size/denom, a handful of roundings in the sqrt, divisions and the subtraction (about
      10 eps of the update); bound 16 eps * (|p| + step_size * S_m / denom).
    In bf16/fp16 the stored values are rounded once more, by at most one eps of the value, which
    these bounds (with that dtype's eps) cover since every S is at least the value it bounds."""
    e = torch.finfo(dtype).eps
    s_m = beta1 * m.abs() + (1 - beta1) * g.abs()
    s_v = beta2 * v + (1 - beta2) * g * g
    denom = s_v.sqrt() / math.sqrt(1 - beta2**step) + eps
    s_p = p.abs() + lr / (1 - beta1**step) * s_m / denom
    return 16 * e * s_p, 4 * e * s_m, 4 * e * s_v


@pytest.fixture
def compare_adamw():
    """`compare_adamw(kernel, reference, params, steps, device)`: three updates of `params` (a
    list of tensors in one dtype) by both, each from the same state so roundings do not compound,
    with weight decay, gradient scale 2 and beta2 = 0.999 (whose 1 - beta2 and bias correction
    need more than fp32). `steps` are the starting step counts (they may differ per tensor).
    Fails on any element past its bound; returns the largest difference as a fraction of it."""

    def compare(kernel, reference, params, steps, device):
        hp = dict(lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8)
        dtype = params[0].dtype
        ps = [p.clone() for p in params]
        ms, vs = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
        steps = [torch.tensor(float(s), device=device) for s in steps]
        scale = torch.tensor(2.0, device=device)
        worst = 0.0
        for i in range(3):
            grads = [(torch.randn(p.shape, device=device) * (i + 1)).to(dtype) for p in ps]
            torch._foreach_add_(steps, 1)
            before = [[t.detach().clone().double() for t in ts] for ts in (ps, ms, vs)]
            ours = [[t.clone() for t in ts] for ts in (ps, ms, vs)]
            kernel(*ours[:1], [g.clone() for g in grads], *ours[1:], steps, **hp, grad_scale=scale)
            reference(ps, [g.clone() for g in grads], ms, vs, steps, **hp, grad_scale=scale)
            for j, g in enumerate(grads):
                bounds = _adamw_bounds(*(state[j] for state in before), g.double() / 2, float(steps[j]), lr=hp["lr"], beta1=hp["beta1"],
                                       beta2=hp["beta2"], eps=hp["eps"], dtype=dtype)
                for name, got, want, bound in zip(("param", "exp_avg", "exp_avg_sq"), ours, (ps, ms, vs), bounds):
                    ratio = ((got[j].double() - want[j].double()).abs() / bound.clamp_min(1e-38)).max().item()
                    assert ratio <= 1.0, f"update {i + 1}, tensor {j} {name}: difference {ratio:.2f} x its bound"
                    worst = max(worst, ratio)
            assert not torch.equal(ours[0][0], before[0][0].to(dtype))
        return worst

    return compare
