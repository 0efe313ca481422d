"""Global batches split into this data-parallel rank's micro-batches (every recipe uses this)."""

from __future__ import annotations


def rank_micro_batches(step: int, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int) -> list[list[int]]:
    """Indices (into the run's sample order, `step * global_batch` onwards) of the micro-batches
    this rank trains on at `step`: the rank's contiguous share of the global batch, in order, so
    the order depends only on the step (a resumed run reads what the uninterrupted one would)."""
    per_rank = global_batch // dp_size
    base = step * global_batch + dp_rank * per_rank
    return [[base + m * micro_batch + i for i in range(micro_batch)] for m in range(per_rank // micro_batch)]
