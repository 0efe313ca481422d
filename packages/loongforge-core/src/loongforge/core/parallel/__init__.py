"""Process groups per model component (tensor, pipeline, data parallel)."""

from loongforge.core.parallel.context import ParallelContext, free_port, init_parallel, on_rank0, single_process_context

__all__ = ["ParallelContext", "free_port", "init_parallel", "on_rank0", "single_process_context"]
