"""Training stacks: how a model is parallelized, how its gradients are synchronized and how its
checkpoint shards are written. One trainer drives every stack through `TrainStack`:
- `megatron`: megatron-core models (TP, PP, DP), dist_checkpointing shards;
- `torch`: any torch module (an HF model as-is) on DDP, ZeRO-1, FSDP2 or HSDP, torch DCP shards.
Both write the same checkpoint layout (step directories, manifest, `latest`)."""

from loongforge.core.stacks.base import TrainStack

__all__ = ["TrainStack"]
