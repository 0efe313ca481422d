"""Tensor parallelism (megatron-style) for models written as plain torch modules, such as the
diffusion transformers: a model is built whole on every rank of the TP group (the same seed, so
the same weights), then each projection keeps its rank's share of the heads or hidden units.

    shard_linear(attn.qkv, group, dim=0, chunks=3)   # column-parallel [q; k; v]: each part split
    shard_linear(attn.out, group, dim=1)             # row-parallel
    y = row_linear(attn.out, attend(column_input(x, group) ...), group)

`column_input` is the identity forward and sums the gradient over the group backward;
`row_linear` sums the partial products forward (the bias added once). A norm over the whole
hidden size of a split activation (`rms_norm`) sums the squares over the group.

Split parameters carry megatron-core's tensor-parallel attributes (`tensor_model_parallel`,
`partition_dim`), so the megatron stack counts them once per TP rank in the gradient norm, and
`sharded_state_dict` describes every parameter to megatron-core's dist_checkpointing (saved and
loaded at any TP size; `load_full_state` slices a whole state dict by the same description). A
fused projection of `chunks` parts keeps the whole model's layout in checkpoints: each part is
split over the ranks, so rank r holds rows [part i, block r] of every part.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

TP_CHUNKS_ATTR = "tp_chunks"  # a split parameter made of this many parts along its split axis


def _rank_size(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


@torch.no_grad()
def shard_param(param: nn.Parameter, group, dim: int, chunks: int = 1) -> nn.Parameter:
    """This rank's share of a whole parameter along `dim` (each of its `chunks` equal parts split
    over the group), marked as split."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    rank, size = _rank_size(group)
    if param.shape[dim] % (chunks * size):
        raise ValueError(f"a parameter of shape {tuple(param.shape)} does not split in {chunks} x {size} along dim {dim}")
    parts = [part.chunk(size, dim=dim)[rank] for part in param.chunk(chunks, dim=dim)]
    local = nn.Parameter(torch.cat(parts, dim=dim).contiguous(), requires_grad=param.requires_grad)
    set_tensor_model_parallel_attributes(local, True, dim, 1)
    setattr(local, TP_CHUNKS_ATTR, chunks)
    return local


def shard_linear(linear: nn.Linear, group, dim: int, chunks: int = 1) -> None:
    """Column-parallel (`dim` 0: output features, bias split alike) or row-parallel (`dim` 1:
    input features, the bias whole, added after the sum) in place."""
    linear.weight = shard_param(linear.weight, group, dim, chunks)
    if dim == 0 and linear.bias is not None:
        linear.bias = shard_param(linear.bias, group, 0, chunks)


def column_input(x: torch.Tensor, group) -> torch.Tensor:
    """The input of column-parallel projections: the same forward, the gradient summed over the
    group (each rank's projections contribute their part)."""
    if group is None:
        return x
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    return copy_to_tensor_model_parallel_region(x, group)


def row_linear(linear: nn.Linear, x: torch.Tensor, group) -> torch.Tensor:
    """A row-parallel projection of this rank's share of the features `x`: the partial products
    summed over the group, then the bias."""
    if group is None:
        return linear(x)
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    y = reduce_from_tensor_model_parallel_region(nn.functional.linear(x, linear.weight), group)
    return y if linear.bias is None else y + linear.bias


def mlp(fc1: nn.Linear, fc2: nn.Linear, x: torch.Tensor, group) -> torch.Tensor:
    """fc2(GELU-tanh(fc1(x))) with fc1 column-parallel and fc2 row-parallel over `group` (or
    whole where it is None): the diffusion transformers' MLP."""
    return row_linear(fc2, nn.functional.gelu(fc1(column_input(x, group)), approximate="tanh"), group)


class _SumOverGroup(torch.autograd.Function):
    """The sum over the group of every rank's `x`, on every rank; each rank's use of the sum
    differs, so the gradient is summed over the group too."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, group, width: int) -> torch.Tensor:
    """RMSNorm over a hidden size of `width` split over the group (x and weight: this rank's
    share), as the op table's reference computes it: in fp32, cast back before the weight."""
    xf = x.float()
    sq = _SumOverGroup.apply(xf.pow(2).sum(-1, keepdim=True), group)
    return weight * (xf * torch.rsqrt(sq / width + eps)).to(x.dtype)


def sharded_state_dict(module: nn.Module, prefix: str = "", sharded_offsets: tuple = ()) -> dict:
    """megatron-core's ShardedTensors of every tensor of `module.state_dict()` under megatron's
    parallel state: split parameters by their rank's offsets along their split axis (a fused one
    as its parts), the rest replicated over the TP group."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    tp_group, dp_group = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group(with_context_parallel=True)
    params = dict(module.named_parameters())
    state = module.state_dict(keep_vars=True)
    axes = {k: params[k].partition_dim for k in state if getattr(params.get(k), "tensor_model_parallel", False)}
    sd = make_sharded_tensors_for_checkpoint(state, prefix, axes, sharded_offsets, tp_group=tp_group, dp_cp_group=dp_group)
    for k, axis in axes.items():
        chunks = getattr(params[k], TP_CHUNKS_ATTR, 1)
        if chunks > 1:
            sh = sd[prefix + k]
            build = _chunked_build(axis, chunks, tuple(sharded_offsets), *_rank_size(tp_group))
            sd[prefix + k] = ShardedTensorFactory(sh.key, sh.data, build, _cat_merge(axis), sh.replica_id)
    return sd


class MegatronCheckpointable:
    """A plain torch model saved and loaded by the megatron stack (`sharded_state_dict` above)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        return sharded_state_dict(self, prefix, sharded_offsets)


def _chunked_build(axis: int, chunks: int, sharded_offsets: tuple, rank: int, size: int):
    """The factory's build: the local tensor's `chunks` parts, part i at block (i * size + rank)
    of chunks x size along `axis` of the whole tensor."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    pre = len(sharded_offsets)

    @torch.no_grad()
    def build(key, t, replica_id, flattened_range):
        return [
            ShardedTensor.from_rank_offsets(
                key, part, *sharded_offsets, (axis + pre, i * size + rank, chunks * size), replica_id=replica_id, prepend_axis_num=pre
            )
            for i, part in enumerate(t.chunk(chunks, dim=axis))
        ]

    return build


def _cat_merge(axis: int):
    def merge(parts):
        with torch.no_grad():
            return torch.cat(parts, dim=axis)

    return merge
