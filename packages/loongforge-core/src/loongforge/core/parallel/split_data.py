"""A computation split by data across a group whose consumer is replicated over it: a VLM's
vision tower with each rank of the language model's TP group encoding some of a pack's images
(the TP ranks share the pack, so without the split every rank would encode every image).

    start, stop = split_items(sizes, group.size())[group.rank()]
    rows = gather_rows(my_rows, group, counts)   # every rank's rows, in rank order

`gather_rows`' backward hands each rank its own rows of the gradient, which every rank holds
whole because the consumer is replicated; the parameters that made the rows then carry the
gradient of their own rank's items only, so the stack sums them over the group
(`SPLIT_DATA_ATTR` on a parameter). Under megatron-core's sequence parallelism the same holds
for the parameters it marks `sequence_parallel` (norms, routers): each TP rank applies them to
its share of the sequence.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

SPLIT_DATA_ATTR = "tp_split_data"  # a parameter attribute: its gradients sum over the TP group


def split_items(sizes: list[int], parts: int) -> list[tuple[int, int]]:
    """Contiguous (start, stop) item ranges for `parts` ranks with near-equal totals of `sizes`
    (a rank may get none); the same on every rank."""
    total = sum(sizes)
    bounds, start, acc = [], 0, 0
    for k in range(parts - 1):
        target = total * (k + 1) / parts
        stop = start
        while stop < len(sizes) and abs(acc + sizes[stop] - target) <= abs(acc - target):
            acc += sizes[stop]
            stop += 1
        bounds.append((start, stop))
        start = stop
    bounds.append((start, len(sizes)))
    return bounds


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group, counts: list[int]) -> torch.Tensor:
        rank = dist.get_rank(group)
        ctx.start, ctx.rows = sum(counts[:rank]), counts[rank]
        buf = x.new_zeros((max(counts), *x.shape[1:]))
        buf[: x.shape[0]] = x
        parts = [torch.empty_like(buf) for _ in counts]
        dist.all_gather(parts, buf, group=group)
        return torch.cat([p[:n] for p, n in zip(parts, counts)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[ctx.start : ctx.start + ctx.rows], None, None


def gather_rows(x: torch.Tensor, group, counts: list[int]) -> torch.Tensor:
    """Every rank's `x` ([counts[rank], ...]) concatenated in rank order, on every rank."""
    if x.shape[0] != counts[dist.get_rank(group)]:
        raise ValueError(f"gather_rows: {x.shape[0]} rows on this rank, counts say {counts[dist.get_rank(group)]}")
    return _GatherRows.apply(x, group, list(counts))


def sum_split_grads(params, group) -> None:
    """Sum over `group` the gradients of parameters that computed on a split of the data (a
    parameter without a gradient on this rank, whose rank had no items, contributes zeros)."""
    from loongforge.core.stacks.grads import buckets

    split = [p for p in params if getattr(p, SPLIT_DATA_ATTR, False) or getattr(p, "sequence_parallel", False)]
    for p in split:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    for bucket in buckets([p.grad for p in split], 1 << 25):
        flat = torch._utils._flatten_dense_tensors(bucket)
        dist.all_reduce(flat, group=group)
        for g, f in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket)):
            g.copy_(f)
