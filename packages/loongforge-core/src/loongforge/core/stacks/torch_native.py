"""The torch-native training stack: any torch module (an HF model as-is) on plain data parallelism.

Modes (`parallel.data_parallel_mode`):
- `ddp`: parameters replicated; after backward one bucketed all-reduce of the flattened
  gradients makes each the mean over ranks (micro-batches accumulate locally first).
- `zero1`: as ddp, but each rank's optimizer holds a balanced share of the parameters (by
  element count) and only their AdamW state; after the step each rank broadcasts its share.
- `fsdp`: `fully_shard` per block (`model.blocks()`) and on the root (FSDP2: parameters,
  gradients and optimizer state sharded, DTensors); the reduce-scatter averages the gradients.
- `hsdp`: FSDP over a 2-D mesh (`data_parallel_replicas` replica rows x shards).
On one rank fsdp and hsdp do not wrap the model (nothing to shard) and train as ddp does.
Every rank sees different data in every mode, so `dp_size` is the world size; with context
parallelism (`context_parallel_size` consecutive ranks splitting each micro-batch's tokens, for
recipes that support it) the ranks of one group see the same samples and their gradients are
summed in the same average.

Precision: fp32; bf16 with fp32 masters (fsdp: MixedPrecisionPolicy over fp32 sharded params;
ddp/zero1: `MasterWeights`); pure bf16 (`master_weights=False`). Checkpoints are torch DCP
shards keyed by parameter names, always fp32, and load at any other mode and world size.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from loongforge.core.checkpoint.dcp_io import load_dcp, save_dcp
from loongforge.core.errors import UserError
from loongforge.core.stacks.base import Select, TrainStack, accumulate
from loongforge.core.stacks.grads import all_reduce_mean, buckets, param_groups, sq_norm
from loongforge.core.train.precision import MasterWeights, PureLowPrecision

MODES = ("ddp", "zero1", "fsdp", "hsdp")
BUCKET_NUMEL = 1 << 25  # elements per flattened broadcast


@torch.no_grad()
def broadcast_tensors(tensors, src: int, group=None) -> None:
    """Give every rank global rank `src`'s values of `tensors` (bucketed and flattened, one
    dtype per bucket)."""
    by_dtype: dict[torch.dtype, list] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        for bucket in buckets(same, BUCKET_NUMEL):
            flat = torch._utils._flatten_dense_tensors(bucket)
            dist.broadcast(flat, src=src, group=group)
            for t, f in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket)):
                t.copy_(f)


def balanced_owners(numels: list[int], ranks: int) -> list[int]:
    """ZeRO-1 ownership: each tensor, largest first (ties by position), goes to the rank with
    the fewest elements so far (ties to the lowest rank); the same on every rank."""
    owner, load = [0] * len(numels), [0] * ranks
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += numels[i]
    return owner


def recompute_block(block: torch.nn.Module) -> None:
    """Activation checkpointing of one block: its forward runs under non-reentrant
    `torch.utils.checkpoint`, replacing the bound method in place so parameter names (and
    so checkpoints) are the same with and without recompute, and fully_shard/compile still
    see the module itself. Without autograd (sampling, evaluation) the block runs plainly: there
    is nothing to recompute, and the checkpoint's per-call bookkeeping (device and RNG state,
    saved-tensor hooks) is host time that a launch-bound sampler such as pi0.5's pays per layer."""
    inner = block.forward

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(inner, *args, use_reentrant=False, **kwargs)

    block.forward = forward


class TorchNativeStack(TrainStack):
    name = "torch"

    def __init__(
        self,
        parallel_cfg,
        device: torch.device,
        params_dtype: torch.dtype = torch.float32,
        master_weights: bool = True,
        recompute: bool = False,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ) -> None:
        mode = parallel_cfg.data_parallel_mode
        if mode not in MODES:
            raise UserError(f"parallel.data_parallel_mode={mode!r} is not a torch-stack mode; choose one of {', '.join(MODES)}")
        tp, pp = parallel_cfg.tensor_model_parallel_size, parallel_cfg.pipeline_model_parallel_size
        if tp * pp > 1:
            raise UserError(
                f"parallel.tensor_model_parallel_size={tp}, parallel.pipeline_model_parallel_size={pp}: the torch stack "
                "has no model parallelism; set both to 1, or use parallel.stack=megatron"
            )
        if not dist.is_initialized():
            raise RuntimeError("TorchNativeStack needs torch.distributed initialized first (init_process_group, also for one process)")
        world = dist.get_world_size()
        replicas = parallel_cfg.data_parallel_replicas
        if mode != "hsdp" and replicas != 1:
            raise UserError(f"parallel.data_parallel_replicas={replicas} applies to data_parallel_mode=hsdp only; set it to 1 or use hsdp")
        if replicas < 1 or world % replicas:
            raise UserError(
                f"parallel.data_parallel_replicas={replicas} must divide the world size {world}; "
                f"choose a divisor of {world} (shards per replica = world size / replicas)"
            )
        from torch.distributed.device_mesh import init_device_mesh

        self.mode = mode
        self.device = torch.device(device)
        self.params_dtype = params_dtype
        self.master_weights = master_weights
        self.recompute = recompute
        self.compile = bool(parallel_cfg.compile)
        self.autocast = autocast
        self.replicas = replicas
        # One rank has nothing to shard: fully_shard would only add all-gather and reduce-scatter
        # copies (torchtitan skips it too), so fsdp/hsdp on one rank train as ddp does.
        self.sharded = mode in ("fsdp", "hsdp") and world > 1
        if mode == "hsdp":
            self.mesh = init_device_mesh(self.device.type, (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))
            self._shard_group = self.mesh.get_group("shard")
        else:
            self.mesh = init_device_mesh(self.device.type, (world,), mesh_dim_names=("dp",))
            self._shard_group = self.mesh.get_group()
        self.dp_size = world
        self.dp_rank = dist.get_rank()
        self.dp_group = dist.group.WORLD if world > 1 else None
        cp = parallel_cfg.context_parallel_size
        if cp < 1 or world % cp:
            raise UserError(f"parallel.context_parallel_size={cp} must divide the world size {world}")
        self.cp_size, self.cp_rank = cp, self.dp_rank % cp
        if cp > 1:  # every rank joins every group's creation, in the same order
            groups = [dist.new_group(list(range(s, s + cp))) for s in range(0, world, cp)]
            self.cp_group = groups[self.dp_rank // cp]
        self.low_precision: MasterWeights | PureLowPrecision | None = None
        self._params: list[torch.nn.Parameter] = []  # every trainable parameter the gradients live on (masters where there are)
        self._owner: list[int] = []  # zero1: owning rank of each of `_params`

    # ---- setup ---------------------------------------------------------------------------
    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """Rank 0's weights to every rank, then precision, recompute, compile and data parallel
        (in that order: the per-block wrappers must exist before fully_shard groups the blocks)."""
        if self.dp_size > 1:
            broadcast_tensors([t.data for t in [*model.parameters(), *model.buffers()]], src=0)
        low = self.params_dtype != torch.float32
        blocks = list(model.blocks()) if hasattr(model, "blocks") else []
        if low and not self.master_weights:
            for p in model.parameters():  # parameters only: buffers such as rotary frequencies stay fp32
                p.data = p.data.to(self.params_dtype)
        elif low and not self.sharded:
            self.low_precision = MasterWeights(model, self.params_dtype)
        if self.recompute:
            for b in blocks:
                recompute_block(b)
        if self.compile:
            for b in blocks:
                b.compile()
        if self.sharded:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mp = (
                MixedPrecisionPolicy(param_dtype=self.params_dtype, reduce_dtype=torch.float32)
                if low and self.master_weights
                else MixedPrecisionPolicy()
            )
            for b in blocks:
                fully_shard(b, mesh=self.mesh, mp_policy=mp)
            fully_shard(model, mesh=self.mesh, mp_policy=mp)
        if isinstance(self.low_precision, MasterWeights):
            self._params = [slot[3] for slot in self.low_precision.slots]
        else:
            self._params = [p for p in {id(p): p for p in model.parameters()}.values() if p.requires_grad]
        if self.mode == "zero1":
            self._owner = balanced_owners([p.numel() for p in self._params], self.dp_size)
        return model

    def make_optimizer(self, model, build):
        """`build` gets [{"params": >=2-D tensors}, {"params": the rest, "weight_decay": 0.0}]
        (the first takes build's own weight decay; an empty group is left out). ZeRO-1: only this
        rank's share. Pure low precision casts the optimizer's state with the parameters."""
        mine = [p for i, p in enumerate(self._params) if self.mode != "zero1" or self._owner[i] == self.dp_rank]
        groups = [g for g in param_groups(mine) if g["params"]]  # DCP's per-name optimizer state needs no empty group
        if not groups and self.mode == "zero1":
            raise UserError(
                f"parallel.data_parallel_mode=zero1 over {self.dp_size} ranks leaves rank {self.dp_rank} no parameters; "
                "use ddp or fewer ranks"
            )
        if not groups:
            raise UserError("the model has no trainable parameters (every one has requires_grad=False)")
        optimizer = build(groups)
        if self.params_dtype != torch.float32 and not self.master_weights and not self.sharded:
            self.low_precision = PureLowPrecision(model, optimizer, self.params_dtype)
        return optimizer

    # ---- one step ------------------------------------------------------------------------
    def zero_grad(self, model=None, optimizer=None) -> None:
        """Drop every gradient the step accumulates into (the masters' too, and under ZeRO-1 the
        parameters this rank's optimizer does not hold)."""
        for p in self._params:
            p.grad = None

    def forward_backward(self, model, microbatches, loss_fn, forward_only: bool = False):
        """Backward of each micro-batch's weighted sum as is (the trainer divides by the global
        weight through the optimizer's grad_scale); FSDP syncs gradients on the last one only."""
        totals = None
        grad_ctx = torch.no_grad() if forward_only else contextlib.nullcontext()
        n = len(microbatches)
        with grad_ctx:
            for i, mb in enumerate(microbatches):
                if self.sharded and not forward_only:
                    model.set_requires_gradient_sync(i == n - 1)
                with self.autocast():
                    s, w, m = loss_fn(model, mb)
                if not forward_only:
                    s.backward()
                totals = accumulate(totals, s, w, m)
        return tuple(totals)

    def finalize_grads(self, model, optimizer) -> None:
        """ddp/zero1: every gradient becomes the mean over ranks; FSDP's reduce-scatter already
        averaged."""
        if not self.sharded and self.dp_size > 1:
            all_reduce_mean([p.grad for p in self._params if p.grad is not None], self.dp_group, self.dp_size)

    def grad_sq_norm(self, model, optimizer) -> torch.Tensor:
        """Squared global gradient norm (fp32 0-d, equal on every rank). FSDP: the local shards'
        squares summed over one replica's shard group; ddp/zero1: every rank holds all of it."""
        grads = [p.grad for p in self._params if p.grad is not None]
        if self.sharded:
            grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        sq = sq_norm([g for g in grads if g.numel()], self.device, optimizer.sum_squares)
        if self.sharded and self._shard_group.size() > 1:
            dist.all_reduce(sq, group=self._shard_group)
        return sq

    def after_step(self, model, optimizer) -> None:
        """ZeRO-1: each rank's updated share to every rank, and the gradients of the parameters
        this rank's optimizer does not hold dropped (a trainer clears only the optimizer's);
        then masters into the bf16 parameters."""
        if self.mode == "zero1" and self.dp_size > 1:
            for r in range(self.dp_size):
                broadcast_tensors([p.data for i, p in enumerate(self._params) if self._owner[i] == r], src=r, group=self.dp_group)
            for i, p in enumerate(self._params):
                if self._owner[i] != self.dp_rank:
                    p.grad = None
        if self.low_precision is not None:
            self.low_precision.copy_to_model()

    # ---- checkpoints and weights -----------------------------------------------------------
    def _fp32_view(self):
        return self.low_precision.fp32_view() if self.low_precision is not None else contextlib.nullcontext()

    def save(self, directory: Path, model, optimizer=None, select: Select = None) -> None:
        with self._fp32_view():
            save_dcp(directory, model, optimizer, select)

    def load(self, directory: Path, model, optimizer=None, optimizer_steps: int = 0, select: Select = None) -> None:
        with self._fp32_view():
            load_dcp(directory, model, optimizer, optimizer_steps, select)

    def full_state_dict(self, model) -> dict[str, torch.Tensor]:
        """The whole model's state dict on every rank (FSDP: gathered; masters where there are),
        keyed like `model.state_dict()`. Unsharded tensors may share storage with the model:
        use them before the next step."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        with self._fp32_view():
            if self.sharded:
                return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
            return dict(model.state_dict())

    def load_full_state_dict(self, model, state: dict) -> None:
        """Whole tensors, the same on every rank, into the prepared model: sharded where FSDP
        shards, into the fp32 masters where there are. `state` is keyed like `model.state_dict()`
        (every key, no other), or, for a model with `state_from_hf` (HFCausalLMWithLoss), may be
        HF's own state dict (strict too)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        with self._fp32_view():
            expected = set(model.state_dict())
            if hasattr(model, "state_from_hf") and state and not expected & set(state):
                state = model.state_from_hf(state)
            missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
            if missing or unexpected:
                raise UserError(
                    f"weights do not match the model: missing {missing[:1]} ({len(missing)}), "
                    f"unexpected {unexpected[:1]} ({len(unexpected)})"
                )
            if self.sharded:
                set_model_state_dict(model, dict(state), options=StateDictOptions(full_state_dict=True))
            else:
                model.load_state_dict(state, strict=True)

    def layout(self) -> dict:
        return {
            "stack": self.name,
            "data_parallel_mode": self.mode,
            "data_parallel_size": self.dp_size,
            "data_parallel_replicas": self.replicas,
            "context_parallel_size": self.cp_size,
        }
