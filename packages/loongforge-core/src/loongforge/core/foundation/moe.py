"""Mixture-of-experts pieces that plug into megatron-core's `MoELayer`: the router (megatron's
top-k router, its auxiliary losses attached without megatron's global loss scale and logged
per layer on the router itself, the expert-load counts the metrics and the aux-loss-free bias
read), the routed experts as stacked weights run through the op table's `moe_expert_mlp` (one
grouped GEMM per projection where the implementation has one), and the fix megatron-core's
router needs without transformer-engine.

Experts are never split by tensor parallelism here (expert TP = 1): expert parallelism places
whole experts on ranks. The expert weights of a layer are two tensors, `fc1` [E, 2F, H] (each
expert's gate rows, then its up rows) and `fc2` [E, H, F]; a rank holds its EP slice of the
first axis, and the checkpoint holds the whole [E, ...] tensor, so a checkpoint saved at one EP
size loads at another.

Auxiliary losses follow the trainer's normalization: the trainer divides the gradient of the
summed micro-batch losses by the global loss weight (megatron's "per-token loss" mode), so each
aux loss (a mean over the micro-batch's tokens) enters backward multiplied by the micro-batch's
token count, which makes it a token-weighted mean over the global batch in the final gradient.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
from loongforge.core.ops import OpTable
from torch import nn


def ensure_router_without_te() -> None:
    """megatron-core 0.16's `moe_utils` imports its transformer-engine helpers in one `try`; when
    that import fails part-way, `te_general_gemm` is never bound and every `TopKRouter` forward
    raises NameError on it. Bind it to None, the value its own code tests for to take the plain
    torch matmul. Touches nothing when the name exists (TE installed, or a fixed megatron-core)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


class _AttachLoss(torch.autograd.Function):
    """Returns `x` unchanged; backward also sends a gradient of 1 into `loss`, so that `loss`
    joins the backward of whatever consumes `x` (an auxiliary loss riding on the activations)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(loss)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (loss,) = ctx.saved_tensors
        return grad, torch.ones_like(loss)


@functools.cache
def router_class():
    """megatron-core's `TopKRouter` whose auxiliary losses (load balancing per micro-batch or per
    sequence, z-loss) join backward scaled by the micro-batch's token count (see the module
    docstring) instead of through megatron's process-wide loss scale, and are kept on the router
    (`stats`) instead of megatron's global tracker. `stats` after a forward: `tokens_per_expert`
    [E] (this rank's tokens routed to each expert, fp32, detached) and each aux loss's value
    (without its coefficient). A factory, so that importing this module does not import
    megatron-core."""
    from megatron.core.transformer.moe.moe_utils import z_loss_func
    from megatron.core.transformer.moe.router import TopKRouter

    class LoadTrackingRouter(TopKRouter):
        def __init__(self, config, pg_collection=None):
            super().__init__(config=config, pg_collection=pg_collection)
            self.stats: dict[str, torch.Tensor] = {}

        def routing(self, logits, padding_mask=None):
            self.stats = {}
            probs, routing_map = super().routing(logits, padding_mask=padding_mask)
            self.stats["tokens_per_expert"] = routing_map.detach().sum(0, dtype=torch.float32)
            return probs, routing_map

        def attach_and_log_load_balancing_loss(
            self, activation, aux_loss_coeff, aux_loss, aux_loss_name, reduce_group, reduce_group_has_dp=False, valid_token_count=None
        ):
            self.stats[aux_loss_name] = (aux_loss / aux_loss_coeff).detach().float()
            tokens = valid_token_count if valid_token_count is not None else activation.shape[0]
            return _AttachLoss.apply(activation, aux_loss * tokens)

        def apply_z_loss(self, logits, padding_mask=None):
            coeff = self.config.moe_z_loss_coeff
            if coeff is None or not (self.training and torch.is_grad_enabled()):
                return logits
            z_loss = z_loss_func(logits, coeff, padding_mask=padding_mask)
            self.stats["z_loss"] = (z_loss / coeff).detach().float()
            tokens = (~padding_mask).sum() if padding_mask is not None else logits.shape[0]
            return _AttachLoss.apply(logits, z_loss * tokens)

    return LoadTrackingRouter


def routers(model: nn.Module) -> list:
    """The MoE routers of a model (this rank's pipeline stage), in layer order."""
    cls = router_class()
    return [m for m in model.modules() if isinstance(m, cls)]


def moe_metrics(model_routers: list, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """A micro-batch's expert-load metrics from its `routers(model)`, each times `weight` (the task contract's weighted
    sums; the trainer reports them divided by the global weight, i.e. averaged over the step's
    micro-batches): per MoE layer (`n` counted from 0, as HF names layers) `moe/layer{n}/load_max_mean` (the busiest expert's tokens over
    the mean, 1.0 = perfectly balanced) and each auxiliary loss the router computed; and
    `moe/load_max_mean`, the mean over this stage's MoE layers. Empty for a dense model."""
    out = {}
    ratios = []
    for r in model_routers:
        if "tokens_per_expert" not in r.stats:
            continue
        load = r.stats["tokens_per_expert"]
        ratio = load.max() / load.mean().clamp(min=1e-12)
        ratios.append(ratio)
        out[f"moe/layer{r.layer_number - 1}/load_max_mean"] = ratio * weight
        for name, value in r.stats.items():
            if name != "tokens_per_expert":
                out[f"moe/layer{r.layer_number - 1}/{name}"] = value * weight
    if ratios:
        out["moe/load_max_mean"] = torch.stack(ratios).mean() * weight
    return out


@torch.no_grad()
def update_expert_biases(model: nn.Module, group) -> None:
    """The aux-loss-free balancing step (DeepSeek-V3): each router with an expert bias moves it
    by its `moe_router_bias_update_rate` towards balance, up for experts that got fewer than the
    mean of the step's tokens and down for those that got more, counted over the data-parallel
    ranks (`group`); then the counts restart. megatron-core does this in its `finalize_model_grads`, which this trainer
    does not use; the megatron stack calls this where it finalizes gradients."""
    for r in routers(model):
        if r.expert_bias is None:
            continue
        counts = r.local_tokens_per_expert
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
        r.expert_bias += torch.sign(counts.mean() - counts) * r.config.moe_router_bias_update_rate
        counts.zero_()


@functools.cache
def moe_layer_class():
    """megatron-core's `MoELayer`, whose tokens, where every expert is on this rank (EP = 1) and
    none is dropped (no capacity factor), go to the experts and back through the op table's
    `moe_permute` / `moe_unpermute` (the permute kernels; no host read of the expert counts),
    the router probabilities applied as the outputs are combined. Other layouts keep megatron's
    all-gather dispatcher (its expert parallelism and token dropping). A factory, so that
    importing this module does not import megatron-core."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

    class LocalTokenDispatcher(MoETokenDispatcher):
        def __init__(self, config, pg_collection, ops: OpTable):
            super().__init__(config=config, pg_collection=pg_collection)
            self.ops = ops
            self.num_experts, self.topk = config.num_moe_experts, config.moe_router_topk

        def dispatch_preprocess(self, tokens, routing_map, probs):
            self.shape = tokens.shape
            # the k experts each token was routed to (routing_map: [tokens, experts] bool) and their probabilities
            self.expert_ids = torch.topk(routing_map.to(torch.float32), self.topk, dim=-1).indices
            self.topk_probs = probs.gather(1, self.expert_ids)
            return tokens.view(-1, tokens.shape[-1]), None

        def token_dispatch(self, hidden_states, probs):
            return hidden_states, probs

        def dispatch_postprocess(self, hidden_states, probs):
            permuted, self.row_ids, tokens_per_expert = self.ops.moe_permute(hidden_states, self.expert_ids, self.num_experts)
            return permuted, tokens_per_expert, None  # (probabilities: applied when combining)

        def combine_preprocess(self, hidden_states):
            return self.ops.moe_unpermute(hidden_states, self.row_ids, self.topk_probs)

        def token_combine(self, hidden_states):
            return hidden_states

        def combine_postprocess(self, hidden_states):
            return hidden_states.view(self.shape)

    class OpTableMoELayer(MoELayer):
        def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, ops: OpTable | None = None):
            super().__init__(config, submodules, layer_number, pg_collection)
            if self.num_local_experts == config.num_moe_experts and config.moe_expert_capacity_factor is None:
                self.token_dispatcher = LocalTokenDispatcher(config, pg_collection, ops or OpTable())

    return OpTableMoELayer


@functools.cache
def grouped_experts_class():
    """The routed experts of one MoE layer on this rank, as megatron's `MoELayer` builds and calls
    them: `experts(num_local_experts, config, pg_collection=)`, then `experts(tokens,
    tokens_per_expert, probs)` on tokens grouped by local expert. A factory, so that importing
    this module does not import megatron-core."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.transformer.module import MegatronModule

    class GroupedExperts(MegatronModule):
        def __init__(self, num_local_experts: int, config, pg_collection=None, ops: OpTable | None = None):
            super().__init__(config=config)
            self.ops = ops or OpTable()
            self.num_local_experts = num_local_experts
            self.ep_group = pg_collection.ep
            self.expt_dp_group = pg_collection.expt_dp
            self.tp_group = pg_collection.tp
            h, f = config.hidden_size, config.moe_ffn_hidden_size
            dtype = config.params_dtype
            self.fc1 = nn.Parameter(torch.empty(num_local_experts, 2 * f, h, dtype=dtype))
            self.fc2 = nn.Parameter(torch.empty(num_local_experts, h, f, dtype=dtype))
            # init: every expert from the global generator in global expert order, so the weights
            # do not depend on the EP layout (as megatron's CPU init for the dense weights)
            ep_rank, ep = self.ep_group.rank(), self.ep_group.size()
            for w, std in ((self.fc1, config.init_method_std), (self.fc2, config.init_method_std / math.sqrt(2.0 * config.num_layers))):
                full = torch.empty(num_local_experts * ep, *w.shape[1:], dtype=torch.float32)
                nn.init.normal_(full, 0.0, std)
                with torch.no_grad():
                    w.copy_(full[ep_rank * num_local_experts : (ep_rank + 1) * num_local_experts])
                # megatron's convention: expert parameters are reduced over the expert-data-parallel group
                w.allreduce = False

        def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor | None):
            """probs None: the dispatcher applies them when it combines the outputs."""
            out = self.ops.moe_expert_mlp(tokens, tokens_per_expert.to(tokens.device), self.fc1, self.fc2)
            return (out if probs is None else out * probs.unsqueeze(-1).to(out.dtype)), None

        def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
            """Each weight as the whole [E, ...] tensor, this rank's EP slice at its expert offset;
            replicated over the tensor-parallel and expert-data-parallel ranks."""
            axis = len(sharded_offsets)
            out = {}
            for name in ("fc1", "fc2"):
                out[prefix + name] = ShardedTensor.from_rank_offsets(
                    prefix + name,
                    getattr(self, name),
                    *sharded_offsets,
                    (axis, self.ep_group.rank(), self.ep_group.size()),
                    replica_id=(0, self.tp_group.rank(), self.expt_dp_group.rank()),
                    prepend_axis_num=axis,
                )
            return out

    return GroupedExperts


def is_expert_param(p: torch.Tensor) -> bool:
    """A routed expert's weight: split over the expert-parallel ranks, its gradient averaged over
    the expert-data-parallel ranks (megatron's `allreduce = False` mark)."""
    return getattr(p, "allreduce", True) is False
