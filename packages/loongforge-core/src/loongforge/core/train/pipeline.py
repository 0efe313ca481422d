"""Forward and backward of one global batch's micro-batches on this rank's pipeline stage.

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


def forward_backward(
    model,
    microbatches: Sequence[dict],
    ctx,
    act_shape: tuple[int, ...],
    act_dtype: torch.dtype,
    device: torch.device,
    autocast,
    forward_only: bool = False,
) -> torch.Tensor:
    """Return the mean micro-batch loss (on every stage). A micro-batch holds `tokens`, `labels`
    and `loss_weights` ([batch, seq] floats): its loss is the weighted sum of its tokens'
    cross-entropies, computed by the model's last stage (the recipe's weights say what kind of
    mean that is). A micro-batch may carry `packed_seq_params` (THD packing); every stage
    receives it."""
    n = len(microbatches)
    losses = []
    if ctx.pp_size == 1:
        for mb in microbatches:
            with autocast():
                loss = model(mb["tokens"], None, None, labels=mb["labels"], loss_mask=mb["loss_weights"], packed_seq_params=mb.get("packed_seq_params"))
            if not forward_only:
                (loss / n).backward()
            losses.append(loss.detach())
        return torch.stack(losses).mean()

    inputs, outputs = [], []
    for mb in microbatches:
        recv = None
        if not ctx.is_first_stage:
            recv = torch.empty(act_shape, dtype=act_dtype, device=device)
            dist.recv(recv, src=ctx.prev_rank, group=ctx.pp_group)
            recv.requires_grad_(not forward_only)
            model.set_input_tensor(recv)
        with torch.set_grad_enabled(not forward_only), autocast():
            out = model(
                mb["tokens"] if ctx.is_first_stage else None,
                None,
                None,
                labels=mb["labels"] if ctx.is_last_stage else None,
                loss_mask=mb["loss_weights"] if ctx.is_last_stage else None,
                packed_seq_params=mb.get("packed_seq_params"),
            )
            if ctx.is_last_stage:
                losses.append(out.detach())
        if not ctx.is_last_stage:
            dist.send(out.detach().to(act_dtype).contiguous(), dst=ctx.next_rank, group=ctx.pp_group)
        inputs.append(recv)
        outputs.append(out)

    if not forward_only:
        for recv, out in zip(inputs, outputs):
            if ctx.is_last_stage:
                (out / n).backward()
            else:
                grad = torch.empty(act_shape, dtype=act_dtype, device=device)
                dist.recv(grad, src=ctx.next_rank, group=ctx.pp_group)
                torch.autograd.backward(out, grad_tensors=grad.to(out.dtype))
            if recv is not None:
                dist.send(recv.grad.to(act_dtype).contiguous(), dst=ctx.prev_rank, group=ctx.pp_group)

    mean = torch.stack(losses).mean() if losses else torch.zeros((), device=device)
    # Every stage reports the loss: the last stage holds it.
    last = dist.get_global_rank(ctx.pp_group, ctx.pp_size - 1)
    dist.broadcast(mean, src=last, group=ctx.pp_group)
    return mean
