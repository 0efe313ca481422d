"""Forward and backward of one global batch's micro-batches on this rank's pipeline stage
(megatron stack).

`loss_fn(model, mb)` is the task's loss: `(weighted_sum, weight, metrics)` on the last stage,
the stage's output activations on the others. Backward runs on each micro-batch's weighted sum
as it is (the trainer divides the gradients by the global weight afterwards).

With PP=1 each micro-batch runs forward then backward. With PP>1 the stages run every forward
first, then every backward (GPipe order), passing activations and their gradients with
point-to-point sends over the pipeline group; it works on gloo and NCCL alike. Activations of
all micro-batches stay alive until their backward (1F1B, which bounds them by the stage count,
is not implemented yet).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from loongforge.core.stacks.base import accumulate


def forward_backward(
    model,
    microbatches: Sequence[dict],
    loss_fn,
    ctx,
    act_shape: tuple[int, ...] | None,
    act_dtype: torch.dtype,
    device: torch.device,
    autocast,
    forward_only: bool = False,
    metric_names: list | None = None,
):
    """This rank's (sum of weighted sums, sum of weights, {metric: sum}) over its micro-batches,
    on every pipeline stage. `metric_names` (PP>1) is a list the first call fills with the
    metric names the last stage reported, so that later calls need not send them again."""
    totals = None
    if ctx.pp_size == 1:
        for mb in microbatches:
            with autocast():
                s, w, metrics = loss_fn(model, mb)
            if not forward_only:
                s.backward()
            totals = accumulate(totals, s, w, metrics)
        return tuple(totals)

    inputs, outputs = [], []
    for mb in microbatches:
        recv = None
        if not ctx.is_first_stage:
            recv = torch.empty(act_shape, dtype=act_dtype, device=device)
            dist.recv(recv, src=ctx.prev_rank, group=ctx.pp_group)
            recv.requires_grad_(not forward_only)
            model.set_input_tensor(recv)
        with torch.set_grad_enabled(not forward_only), autocast():
            out = loss_fn(model, mb)
        if ctx.is_last_stage:
            totals = accumulate(totals, *out)
            out = out[0]
        else:
            dist.send(out.detach().to(act_dtype).contiguous(), dst=ctx.next_rank, group=ctx.pp_group)
        inputs.append(recv)
        outputs.append(out)

    if not forward_only:
        for recv, out in zip(inputs, outputs):
            if ctx.is_last_stage:
                out.backward()
            else:
                grad = torch.empty(act_shape, dtype=act_dtype, device=device)
                dist.recv(grad, src=ctx.next_rank, group=ctx.pp_group)
                torch.autograd.backward(out, grad_tensors=grad.to(out.dtype))
            if recv is not None:
                dist.send(recv.grad.to(act_dtype).contiguous(), dst=ctx.prev_rank, group=ctx.pp_group)

    # Every stage reports the sums: the last stage holds them.
    last = dist.get_global_rank(ctx.pp_group, ctx.pp_size - 1)
    names = metric_names if metric_names is not None else []
    if not names:  # the first call: the other stages learn the metric names once
        box = [sorted(totals[2]) if ctx.is_last_stage else None]
        dist.broadcast_object_list(box, src=last, group=ctx.pp_group)
        names.extend(box[0] or [""])  # "" marks "no metrics" as known
    keys = [n for n in names if n]
    if ctx.is_last_stage:
        flat = torch.stack([totals[0], totals[1], *(totals[2][k] for k in keys)])
    else:
        flat = torch.empty(2 + len(keys), dtype=torch.float32, device=device)
    dist.broadcast(flat, src=last, group=ctx.pp_group)
    return flat[0], flat[1], {k: flat[2 + i] for i, k in enumerate(keys)}
