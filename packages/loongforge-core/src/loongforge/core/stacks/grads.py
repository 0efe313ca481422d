"""Gradient and parameter-group helpers every stack uses."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from loongforge.core.ops import reference


def param_groups(params) -> list[dict]:
    """AdamW groups over the trainable parameters: matrices take the optimizer's weight decay,
    vectors (norms, biases) none. A parameter's `lr_scale` attribute (set by a task: a part of the
    model trained at a multiple of the schedule's rate) puts it in groups of that `lr_scale`,
    which the trainer multiplies into each step's learning rate."""
    groups: dict[float, tuple[list, list]] = {1.0: ([], [])}
    for p in params:
        if p.requires_grad:
            decay, no_decay = groups.setdefault(float(getattr(p, "lr_scale", 1.0)), ([], []))
            (no_decay if p.dim() < 2 else decay).append(p)
    out = []
    for scale, (decay, no_decay) in groups.items():
        extra = {} if scale == 1.0 else {"lr_scale": scale}
        out += [{"params": decay, **extra}, {"params": no_decay, "weight_decay": 0.0, **extra}]
    return out


def buckets(tensors, size):
    """Consecutive groups of tensors of about `size` elements (one collective each)."""
    bucket, n = [], 0
    for t in tensors:
        bucket.append(t)
        n += t.numel()
        if n >= size:
            yield bucket
            bucket, n = [], 0
    if bucket:
        yield bucket


def all_reduce_mean(grads: list[torch.Tensor], group, size: int) -> None:
    """Mean of the gradients over `group`, in flattened buckets of 32M elements."""
    for bucket in buckets(grads, 1 << 25):
        flat = torch._utils._flatten_dense_tensors(bucket)
        dist.all_reduce(flat, group=group)
        flat /= size
        for g, f in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket)):
            g.copy_(f)


def sq_norm(tensors, device, sum_squares: Callable = reference.sum_squares) -> torch.Tensor:
    """Sum of squares of `tensors` in fp32 by `sum_squares` (an op table's); 0 for none."""
    tensors = [t.detach() for t in tensors]
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    return sum_squares(tensors)


def grad_sq_norm(params, device, sum_squares: Callable = reference.sum_squares) -> torch.Tensor:
    """Sum of squares of the parameters' gradients (see `sq_norm`)."""
    return sq_norm([p.grad for p in params if p.grad is not None], device, sum_squares)
