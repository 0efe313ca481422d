"""Process groups per model component (tensor, pipeline, data parallel)."""

from loongforge.core.parallel.context import ParallelContext, init_parallel, free_port

__all__ = ["ParallelContext", "init_parallel", "free_port"]
