"""The interface the trainer drives a stack through."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

Select = Optional[Callable[[str], bool]]  # model tensor name -> whether checkpoint I/O covers it


class TrainStack:
    name = "base"
    dp_size: int = 1  # ranks whose gradients are averaged (each sees different data, or another share of the same tokens under CP)
    dp_rank: int = 0
    dp_group = None  # process group over those ranks (None with one)
    cp_size: int = 1  # context parallel: consecutive ranks that split each micro-batch's tokens
    cp_rank: int = 0
    cp_group = None

    @property
    def data_size(self) -> int:
        """Ranks that see different data."""
        return self.dp_size // self.cp_size

    @property
    def data_rank(self) -> int:
        return self.dp_rank // self.cp_size

    activation_shape = None  # pipeline parallel: the task's activations between stages (the trainer sets it)

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """Wrap or shard the built model (precision, data parallel, recompute, compile); the
        optimizer is built over the returned module's parameters."""
        return model

    def make_optimizer(self, model: torch.nn.Module, build: Callable[[list[dict]], torch.optim.Optimizer]) -> torch.optim.Optimizer:
        """`build(param_groups)` over the trainable parameters (decay for >=2-D tensors, none for
        the rest); a sharded-optimizer stack gives it only this rank's share."""
        raise NotImplementedError

    def zero_grad(self, model, optimizer) -> None:
        """Drop every gradient the next step accumulates into."""
        optimizer.zero_grad(set_to_none=True)

    def forward_backward(self, model, microbatches: Sequence[dict], loss_fn, forward_only: bool = False):
        """Run `loss_fn(model, mb)` (and backward of its weighted sum) over this rank's
        micro-batches; return this rank's (sum of weighted sums, sum of weights, {metric: sum}),
        0-d fp32 tensors on the device (with pipeline parallelism: on every stage)."""
        raise NotImplementedError

    def finalize_grads(self, model, optimizer) -> None:
        """Make every gradient the mean over data-parallel ranks of the local ones (a no-op
        where backward already did so)."""

    def grad_sq_norm(self, model, optimizer) -> torch.Tensor:
        """Squared L2 norm of the whole model's gradient, every element counted once, fp32 0-d on
        the device, equal on every rank."""
        raise NotImplementedError

    def after_step(self, model, optimizer) -> None:
        """After the optimizer step was queued (ZeRO-1: hand the updated shards to every rank)."""

    def all_reduce_dp(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the data-parallel ranks in place; returns it."""
        if self.dp_size > 1:
            torch.distributed.all_reduce(t, group=self.dp_group)
        return t

    def save(self, directory: Path, model, optimizer=None, select: Select = None) -> None:
        """Write the model (and optimizer) shards into `directory` (every rank calls it)."""
        raise NotImplementedError

    def load(self, directory: Path, model, optimizer=None, optimizer_steps: int = 0, select: Select = None) -> None:
        """Read shards written by `save` (possibly at another layout) into the prepared model;
        the optimizer's step counts are set to `optimizer_steps`."""
        raise NotImplementedError

    def layout(self) -> dict:
        """The parallel layout, for the manifest."""
        return {"stack": self.name, "data_parallel_size": self.dp_size}


def accumulate(totals: list | None, s: torch.Tensor, w, metrics: dict) -> list:
    """Running [weighted sum, weight, {metric: sum}] of micro-batch losses (detached, fp32), as
    every stack's `forward_backward` returns them."""
    vals = [s.detach().float(), torch.as_tensor(w, device=s.device).detach().float(), {k: v.detach().float() for k, v in metrics.items()}]
    if totals is None:
        return vals
    totals[0] = totals[0] + vals[0]
    totals[1] = totals[1] + vals[1]
    totals[2] = {k: totals[2][k] + v for k, v in vals[2].items()}
    return totals
