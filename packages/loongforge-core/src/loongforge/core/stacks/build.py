"""The stack a run config asks for (`parallel.stack`)."""

from __future__ import annotations

import torch
from loongforge.core.errors import UserError

STACKS = ("megatron", "torch")


def build_stack(parallel_cfg, train_cfg, acc, params_dtype: torch.dtype):
    """Join the process group and lay out the ranks for `parallel_cfg.stack`; returns
    (stack, ParallelContext or None). The megatron stack's context gives TP/PP/DP groups; the
    torch stack has data parallelism only."""
    from loongforge.core.train.run_dir import check_batch_sizes

    par = parallel_cfg
    if par.stack not in STACKS:
        raise UserError(f"parallel.stack={par.stack!r}: choose one of {', '.join(STACKS)}")
    if par.stack == "megatron":
        from loongforge.core.parallel import init_parallel
        from loongforge.core.stacks.megatron import MegatronStack

        ctx = init_parallel(
            par.tensor_model_parallel_size,
            par.pipeline_model_parallel_size,
            acc.backend,
            acc.device_type,
            ep=par.expert_model_parallel_size,
        )
        check_batch_sizes(train_cfg, ctx.dp_size)
        return MegatronStack(ctx, acc, params_dtype, train_cfg.master_weights), ctx
    if par.tensor_model_parallel_size != 1 or par.pipeline_model_parallel_size != 1 or par.expert_model_parallel_size != 1:
        raise UserError(
            "parallel.stack=torch has data parallelism only: set tensor_model_parallel_size=1, "
            "pipeline_model_parallel_size=1 and expert_model_parallel_size=1, or use parallel.stack=megatron"
        )
    from loongforge.core.parallel.distributed import init_process_group
    from loongforge.core.stacks.torch_native import TorchNativeStack

    init_process_group(acc.backend, acc.device_type)
    stack = TorchNativeStack(par, acc.device(), params_dtype, train_cfg.master_weights, train_cfg.recompute, autocast=acc.autocast)
    check_batch_sizes(train_cfg, stack.dp_size)
    return stack, None
