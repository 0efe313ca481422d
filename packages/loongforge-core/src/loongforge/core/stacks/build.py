"""The stack a run config asks for (`parallel.stack`)."""

from __future__ import annotations

import torch
from loongforge.core.errors import UserError

STACKS = ("megatron", "torch")


def expert_replication(par, ep: int):
    """(spare slots, replan interval, EP ranks per node) of `parallel.expert_*`, or None without
    replication."""
    import os

    if par.expert_spare_slots < 0 or par.expert_replan_interval < 1:
        raise UserError(
            f"parallel.expert_spare_slots={par.expert_spare_slots} must be at least 0 and "
            f"parallel.expert_replan_interval={par.expert_replan_interval} at least 1"
        )
    if not par.expert_spare_slots:
        return None
    if ep == 1:
        raise UserError(
            f"parallel.expert_spare_slots={par.expert_spare_slots} replicates experts across expert-parallel ranks: "
            "set parallel.expert_model_parallel_size > 1 (or expert_spare_slots=0)"
        )
    per_node = par.ranks_per_node or min(ep, int(os.environ.get("LOCAL_WORLD_SIZE", ep)))
    if per_node < 1 or ep % per_node:
        raise UserError(f"parallel.ranks_per_node={per_node} must divide expert_model_parallel_size={ep}")
    return par.expert_spare_slots, par.expert_replan_interval, per_node


def build_stack(parallel_cfg, train_cfg, acc, params_dtype: torch.dtype, context_parallel: bool = False):
    """Join the process group and lay out the ranks for `parallel_cfg.stack`; returns
    (stack, ParallelContext or None). The megatron stack's context gives TP/PP/DP groups; the
    torch stack has data parallelism, and context parallelism for recipes whose models split a
    sample's tokens (`context_parallel`)."""
    from loongforge.core.train.run_dir import check_batch_sizes

    par = parallel_cfg
    if par.stack not in STACKS:
        raise UserError(f"parallel.stack={par.stack!r}: choose one of {', '.join(STACKS)}")
    if par.context_parallel_size != 1 and not context_parallel:
        raise UserError(
            f"parallel.context_parallel_size={par.context_parallel_size}: this recipe has no context parallelism; set it to 1 "
            "(diffusion.wan and diffusion.qwen_image support it)"
        )
    if par.stack == "megatron":
        from loongforge.core.parallel import init_parallel
        from loongforge.core.stacks.megatron import MegatronStack

        ctx = init_parallel(
            par.tensor_model_parallel_size,
            par.pipeline_model_parallel_size,
            acc.backend,
            acc.device_type,
            ep=par.expert_model_parallel_size,
            sequence_parallel=par.sequence_parallel,
            cp=par.context_parallel_size,
        )
        check_batch_sizes(train_cfg, ctx.data_size)
        return MegatronStack(ctx, acc, params_dtype, train_cfg.master_weights, expert_replication(par, ctx.ep_size)), ctx
    if (
        par.tensor_model_parallel_size != 1
        or par.pipeline_model_parallel_size != 1
        or par.expert_model_parallel_size != 1
        or par.sequence_parallel
    ):
        raise UserError(
            "parallel.stack=torch has data parallelism only: set tensor_model_parallel_size=1, "
            "pipeline_model_parallel_size=1, expert_model_parallel_size=1 and sequence_parallel=false, or use parallel.stack=megatron"
        )
    from loongforge.core.parallel.distributed import init_process_group
    from loongforge.core.stacks.torch_native import TorchNativeStack

    init_process_group(acc.backend, acc.device_type)
    stack = TorchNativeStack(par, acc.device(), params_dtype, train_cfg.master_weights, train_cfg.recompute, autocast=acc.autocast)
    check_batch_sizes(train_cfg, stack.data_size)
    return stack, None
