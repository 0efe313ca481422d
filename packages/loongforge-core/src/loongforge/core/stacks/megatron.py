"""The megatron stack: megatron-core models (TP, PP and DP from a `ParallelContext`), our own
data-parallel gradient all-reduce and pipeline schedule, dist_checkpointing shards.

Low-precision parameters live here too: bf16 parameters with fp32 masters (`MasterWeights`,
applied in `prepare`, the optimizer built over the masters) or pure bf16 (`PureLowPrecision`,
applied once the optimizer exists). Checkpoint I/O always sees fp32 tensors.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist
from loongforge.core.checkpoint import load_full_state, load_megatron, save_megatron
from loongforge.core.foundation.moe import finish_step, is_expert_param, replan_experts
from loongforge.core.parallel.split_data import sum_split_grads
from loongforge.core.stacks.base import Select, TrainStack
from loongforge.core.stacks.grads import all_reduce_mean, grad_sq_norm, param_groups
from loongforge.core.train.pipeline import forward_backward
from loongforge.core.train.precision import MasterWeights, PureLowPrecision


class MegatronStack(TrainStack):
    name = "megatron"

    def __init__(self, ctx, acc, params_dtype: torch.dtype = torch.float32, master_weights: bool = True, expert_replication=None) -> None:
        self.ctx = ctx
        self.acc = acc
        self.device = acc.device()
        self.params_dtype = params_dtype
        self.master_weights = master_weights
        self.dp_size, self.dp_rank, self.dp_group = ctx.dp_size, ctx.dp_rank, ctx.dp_group
        if ctx.cp_size > 1:  # Ulysses: consecutive ranks of the data-parallel group share each micro-batch
            self.cp_size, self.cp_rank, self.cp_group = ctx.cp_size, dist.get_rank(ctx.cp_group), ctx.cp_group
        self.low: MasterWeights | PureLowPrecision | None = None
        self._metric_names: list = []
        self._trained: list = []
        self._counted: list = []  # parameters in the gradient norm: dense (each counted on one TP rank) ...
        self._counted_experts: list = []  # ... and routed experts (each on one EP rank)
        self.expert_replication = expert_replication  # (spare slots, replan interval, EP ranks per node) or None
        self._finalized = 0  # steps whose gradients were finalized

    def prepare(self, model):
        if self.params_dtype != torch.float32 and self.master_weights:
            self.low = MasterWeights(model, self.params_dtype)
        return model

    def fp32_view(self):
        """The model with fp32 parameters (the masters) in its slots, for weight and checkpoint I/O."""
        return self.low.fp32_view() if self.low is not None else contextlib.nullcontext()

    def make_optimizer(self, model, build):
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        with self.fp32_view():
            optimizer = build(param_groups(model.parameters()))
        self._trained = [p for g in optimizer.param_groups for p in g["params"]]
        # counted once in the global norm: not the second copy of a shared embedding, not a
        # TP-replicated parameter on ranks other than TP rank 0; with EP > 1 each routed expert
        # lives on one rank of its EP group, whatever that rank's place in the TP group
        counted = [p for p in self._trained if param_is_not_shared(p)]
        self._counted = [p for p in counted if not is_expert_param(p) and param_is_not_tensor_parallel_duplicate(p, self.ctx.tp_group)]
        experts = [p for p in counted if is_expert_param(p)]
        if self.ctx.ep_size == 1:
            experts = [p for p in experts if param_is_not_tensor_parallel_duplicate(p, self.ctx.tp_group)]
        self._counted_experts = experts
        if self.params_dtype != torch.float32 and not self.master_weights:
            self.low = PureLowPrecision(model, optimizer, self.params_dtype)
        return optimizer

    def forward_backward(self, model, microbatches, loss_fn, forward_only: bool = False):
        # activations between pipeline stages travel in the parameters' dtype
        return forward_backward(
            model,
            microbatches,
            loss_fn,
            self.ctx,
            self.activation_shape,
            self.params_dtype,
            self.device,
            self.acc.autocast,
            forward_only=forward_only,
            metric_names=self._metric_names,
        )

    def finalize_grads(self, model, optimizer) -> None:
        ctx = self.ctx
        if ctx.tp_size > 1:  # parts computed on a split of the TP group's data (a VLM's ViT, q/k norms, sequence parallelism)
            sum_split_grads(self._trained, ctx.tp_group)
        if ctx.pp_size > 1 and ctx.embedding_group is not None:
            for p in self._trained:
                if getattr(p, "shared_embedding", False) and p.grad is not None:
                    dist.all_reduce(p.grad, group=ctx.embedding_group)
        grads = [p.grad for p in self._trained if p.grad is not None and not is_expert_param(p)]
        expert_grads = [p.grad for p in self._trained if p.grad is not None and is_expert_param(p)]
        if ctx.dp_size > 1:
            all_reduce_mean(grads, ctx.dp_group, ctx.dp_size)
        if ctx.dp_size > 1 or dist.get_world_size(ctx.expert_dp_group) > 1:
            # a rank's expert gradients already sum over the tokens of its whole EP group (the
            # dispatcher gathered them): summed over the ranks holding the same experts (with
            # sequence parallelism at EP = 1 these include the TP ranks, each routing its share
            # of the sequence), they cover the global batch once; / dp_size makes them the mean
            # the dense ones are
            all_reduce_mean(expert_grads, ctx.expert_dp_group, ctx.dp_size)
        finish_step(model, ctx.tp_dp_group if ctx.sequence_parallel else ctx.dp_group)
        self._finalized += 1
        if self.expert_replication is not None and self._finalized % self.expert_replication[1] == 0:
            spare, _, per_node = self.expert_replication
            replan_experts(model, ctx.dp_group, spare, per_node)

    def grad_sq_norm(self, model, optimizer) -> torch.Tensor:
        ctx = self.ctx
        # (every rank of a group joins its all-reduce, holding experts or not: a pipeline stage
        # of dense layers has none)
        if ctx.ep_size == 1:  # experts are placed like the dense weights: one sum
            sq = grad_sq_norm(self._counted + self._counted_experts, self.device, optimizer.sum_squares)
            if ctx.tp_size * ctx.pp_size > 1:
                dist.all_reduce(sq, group=ctx.mp_group)
            return sq
        sq = grad_sq_norm(self._counted, self.device, optimizer.sum_squares)
        if ctx.tp_size * ctx.pp_size > 1:
            dist.all_reduce(sq, group=ctx.mp_group)
        expert_sq = grad_sq_norm(self._counted_experts, self.device, optimizer.sum_squares)  # each expert lives on one rank of its EP group
        dist.all_reduce(expert_sq, group=ctx.expert_mp_group)
        return sq + expert_sq

    def after_step(self, model, optimizer) -> None:
        if self.low is not None:
            self.low.copy_to_model()  # (unchanged masters after a skipped step)

    def save(self, directory: Path, model, optimizer=None, select: Select = None) -> None:
        with self.fp32_view():
            save_megatron(directory, model, optimizer, select)

    def load(self, directory: Path, model, optimizer=None, optimizer_steps: int = 0, select: Select = None) -> None:
        with self.fp32_view():
            load_megatron(directory, model, optimizer, optimizer_steps=optimizer_steps, select=select)

    def load_full_state_dict(self, model, state: dict, skip=None) -> None:
        """A whole TP=1 LoongForge state dict (e.g. mapped from HF) into this rank's shards, at
        any TP/PP layout, in process."""
        with self.fp32_view():
            load_full_state(model, state, skip)

    def layout(self) -> dict:
        return {"stack": self.name, **self.ctx.layout()}
