"""AdamW whose update runs through the op table's `adamw` (torch's fused kernel in the reference,
a faster one where a plugin registers it). Parameter groups, hyper-parameters, the state layout
(`step`, `exp_avg`, `exp_avg_sq`, steps on the parameters' device) and so checkpoints are
exactly torch.optim.AdamW's with fused=True; clipping arrives as its `grad_scale` and the
NaN/Inf guard's verdict as its `found_inf` (attributes, as torch's GradScaler sets them on fused
optimizers): a skipped step is decided on the device and leaves parameters, moments and step
counts as they were, so the host need not wait for it before queueing the update."""

from __future__ import annotations

from typing import Callable

import torch
from loongforge.core.ops import reference


class TableAdamW(torch.optim.AdamW):
    def __init__(self, params, update: Callable = reference.adamw, **kwargs) -> None:
        super().__init__(params, fused=True, **kwargs)
        self.update = update

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("TableAdamW.step takes no closure")
        scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        increment = 1 if found_inf is None else 1 - found_inf  # a skipped step does not count
        for group in self.param_groups:
            lists: dict[tuple, tuple[list, ...]] = {}  # one update call per (param dtype, grad dtype, device)
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                ps, gs, ms, vs, steps = lists.setdefault((p.dtype, p.grad.dtype, p.device), ([], [], [], [], []))
                ps.append(_local(p))
                gs.append(_local(p.grad))
                ms.append(_local(st["exp_avg"]))
                vs.append(_local(st["exp_avg_sq"]))
                steps.append(st["step"])
            beta1, beta2 = group["betas"]
            for ps, gs, ms, vs, steps in lists.values():
                torch._foreach_add_(steps, increment if found_inf is None else [increment] * len(steps))
                self.update(
                    ps,
                    gs,
                    ms,
                    vs,
                    steps,
                    lr=group["lr"],
                    beta1=beta1,
                    beta2=beta2,
                    weight_decay=group["weight_decay"],
                    eps=group["eps"],
                    grad_scale=scale,
                    found_inf=found_inf,
                )
        return None


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2 parameters, gradients and AdamW state), which the
    update writes in place; a plain tensor as it is. Kernels take plain tensors only."""
    return t.to_local() if hasattr(t, "to_local") else t
