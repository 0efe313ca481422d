"""Ulysses context parallelism: attention over a sequence split across the ranks of a group by
two all-to-alls, one that trades the sequence split for a head split before attention and one
that trades it back after (DeepSpeed-Ulysses). Each rank holds `tokens / cp` consecutive tokens
of the whole sequence between attentions; inside attention it holds every token for `heads / cp`
heads, so attention itself (packed samples included) runs unchanged.

    q, k, v = (seq_to_heads(t, group) for t in (q, k, v))   # [T/cp, H, d] -> [T, H/cp, d]
    out = heads_to_seq(attend(q, k, v), group)               # [T, H/cp, d] -> [T/cp, H, d]

Tokens every rank holds whole (a joint attention's few text tokens) join the attention by
`head_share` (this rank's heads of them) and leave it by `gather_heads` (all heads again).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def local_range(total: int, rank: int, size: int) -> tuple[int, int]:
    """The tokens [start, end) of `total` that `rank` of `size` holds (chunks of ceil(total /
    size); the last rank's chunk is short by the padding the caller adds to fill it)."""
    chunk = -(-total // size)
    return min(total, rank * chunk), min(total, (rank + 1) * chunk)


def padded_range(total: int, group) -> tuple[int, int, int]:
    """(pad, start, end): the tokens that make `total` a multiple of the group's size, and this
    rank's tokens [start, end) of the padded row."""
    cp = dist.get_world_size(group)
    pad = -total % cp
    return (pad, *local_range(total + pad, dist.get_rank(group), cp))


class _AllToAll(torch.autograd.Function):
    """all_to_all_single along dim 0 in chunks of equal size; its gradient is the same exchange."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()  # (empty_like of a strided view would keep its strides)
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[tokens / cp, heads, d] on each rank -> [tokens, heads / cp, d]: every rank's tokens (in
    rank order) for this rank's share of the heads."""
    cp = dist.get_world_size(group)
    t, h, d = x.shape
    if h % cp:
        raise ValueError(f"context parallel size {cp} must divide the {h} attention heads")
    chunks = x.reshape(t, cp, h // cp, d).transpose(0, 1)  # chunk j: head group j, for rank j
    return _AllToAll.apply(chunks, group).reshape(cp * t, h // cp, d)


def heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """The inverse of `seq_to_heads`: [tokens, heads / cp, d] -> [tokens / cp, heads, d]."""
    cp = dist.get_world_size(group)
    t, h, d = x.shape
    back = _AllToAll.apply(x.reshape(cp, t // cp, h, d), group)  # chunk i: head group i of my tokens
    return back.transpose(0, 1).reshape(t // cp, cp * h, d)


def head_share(x: torch.Tensor, group) -> torch.Tensor:
    """[tokens, heads, d], the same on every rank -> [tokens, heads / cp, d]: this rank's heads (the
    share `seq_to_heads` gives it)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    h = x.shape[1] // cp
    return x[:, rank * h : (rank + 1) * h]


class _GatherHeads(torch.autograd.Function):
    """[tokens, heads / cp, d] -> [tokens, heads, d] (every rank's heads, in rank order). Every rank
    goes on with its own copy of the result, so the gradient of this rank's heads is the sum of
    every copy's gradient of them."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)  # all_reduce works in place
        dist.all_reduce(grad, group=ctx.group)
        return head_share(grad, ctx.group), None


def gather_heads(x: torch.Tensor, group) -> torch.Tensor:
    """The inverse of `head_share` for tokens every rank holds: [tokens, heads / cp, d] -> [tokens,
    heads, d] on every rank."""
    return _GatherHeads.apply(x, group)
