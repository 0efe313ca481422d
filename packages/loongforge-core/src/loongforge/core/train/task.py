"""The training-task contract: what a recipe hands the trainer.

A task builds this rank's model, yields each step's micro-batches for this rank, and computes
one micro-batch's loss as `(weighted_sum, weight, metrics)`. The trainer sums both over the
step's micro-batches and the data-parallel ranks and optimizes `sum / weight`: a token mean when
the weights are loss-mask tokens, a sample mean when each sample's weights sum to one, a frame
or pixel mean for a diffusion loss. It knows nothing of tokens, models or loss functions.

    class MyTask(TrainingTask):
        unit = "samples"
        def build_model(self): ...
        def batches(self, start_step): ...        # yields [micro_batch, ...] per step
        def loss(self, model, mb):
            pred = model(mb["x"])
            err = (pred - mb["y"]).square().flatten(1).mean(1)
            return err.sum(), torch.tensor(float(len(err))), {}

With pipeline parallelism (megatron stack) `loss` runs on every stage: on a stage before the
last it returns the stage's output activations (a tensor) instead of the tuple.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator, Optional

import torch


class TrainingTask:
    """Base class of every recipe's task; override what the recipe has."""

    unit: str = "tokens"  # what `units_per_step` counts: tokens, samples, frames
    units_per_step: int = 0  # units in one global batch (throughput = units / step time)
    flops_per_step: float = 0.0  # model FLOPs of one global batch, forward + backward (for MFU; 0: unknown)
    activation_shape: Optional[tuple] = None  # pipeline parallel: shape of the activations between stages
    trainable_only: bool = False  # checkpoints hold only trainable tensors (LoRA); the rest comes from initial_weights

    def build_model(self) -> torch.nn.Module:
        """This rank's model (pipeline stage), on the device, before any stack wrapping."""
        raise NotImplementedError

    def batches(self, start_step: int) -> Iterator[list[dict]]:
        """From `start_step` on, this rank's micro-batches of each global step."""
        raise NotImplementedError

    def loss(self, model, micro_batch: dict):
        """`(weighted_sum, weight, metrics)`: 0-d tensors on the device (metrics: name -> weighted
        sum, reported divided by the weight like the loss). No host sync."""
        raise NotImplementedError

    def eval_batches(self) -> Optional[Iterable[list[dict]]]:
        """Micro-batch lists of the evaluation set (None: no evaluation)."""
        return None

    def initial_weights(self, model, optimizer, stack) -> int:
        """Load the starting weights (and optionally optimizer state) into the prepared model;
        return how many optimizer steps that state has seen (0 for none). Runs on a fresh start,
        and on resume too when `trainable_only`."""
        return 0

    def on_saved(self, step_dir: Path, final: bool) -> None:
        """A checkpoint landed (rank 0 only)."""
