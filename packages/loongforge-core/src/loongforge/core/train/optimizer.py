"""AdamW whose update runs through the op table's `adamw` (torch's fused kernel in the reference,
a faster one where a plugin registers it), and whose gradients' sum of squares for clipping runs
through its `sum_squares`. Parameter groups, hyper-parameters, the state layout
(`step`, `exp_avg`, `exp_avg_sq`, steps on the parameters' device) and so checkpoints are
exactly torch.optim.AdamW's with fused=True; clipping arrives as its `grad_scale` and the
NaN/Inf guard's verdict as its `found_inf` (attributes, as torch's GradScaler sets them on fused
optimizers): a skipped step is decided on the device and leaves parameters, moments and step
counts as they were, so the host need not wait for it before queueing the update.

With `ema_decay` > 0 each parameter's state also holds `ema`, an exponential moving average of the
parameter after every update (`ema = decay * ema + (1 - decay) * param`, starting from the
parameter before the first update, as openpi keeps it), in the parameter's dtype (the fp32
masters under bf16 mixed precision); a skipped step leaves it as it was too. As optimizer state it
is saved, resharded and resumed with the moments."""

from __future__ import annotations

from typing import Callable

import torch
from loongforge.core.ops import reference


class TableAdamW(torch.optim.AdamW):
    def __init__(
        self, params, update: Callable = reference.adamw, ema_decay: float = 0.0, sum_squares: Callable = reference.sum_squares, **kwargs
    ) -> None:
        super().__init__(params, fused=True, **kwargs)
        self.update = update
        self.sum_squares = sum_squares  # the stacks' gradient norm for clipping runs through it
        self.ema_decay = ema_decay

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
                    init_adamw_state(st, p, self.ema_decay)
                ps, gs, ms, vs, steps, emas = lists.setdefault((p.dtype, p.grad.dtype, p.device), ([], [], [], [], [], []))
                ps.append(_local(p))
                gs.append(_local(p.grad))
                ms.append(_local(st["exp_avg"]))
                vs.append(_local(st["exp_avg_sq"]))
                steps.append(st["step"])
                if self.ema_decay:
                    emas.append(_local(st["ema"]))
            beta1, beta2 = group["betas"]
            for ps, gs, ms, vs, steps, emas in lists.values():
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
                if emas:
                    weight = 1 - self.ema_decay if found_inf is None else (1 - found_inf) * (1 - self.ema_decay)
                    torch._foreach_lerp_(emas, ps, weight)
        return None


def init_adamw_state(st: dict, p: torch.Tensor, ema_decay: float, step=None) -> None:
    """A parameter's fresh state: step 0 (on the parameter's device unless `step` is given), zero
    moments, and with `ema_decay` > 0 the EMA starting at the parameter."""
    st["step"] = torch.zeros((), dtype=torch.float32, device=p.device) if step is None else step
    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    if ema_decay:
        st["ema"] = p.detach().clone(memory_format=torch.preserve_format)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2 parameters, gradients and AdamW state), which the
    update writes in place; a plain tensor as it is. Kernels take plain tensors only."""
    return t.to_local() if hasattr(t, "to_local") else t
