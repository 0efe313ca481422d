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


def attach_loss(x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """`x` unchanged, with `loss` joining the backward of whatever consumes `x`."""
    return _AttachLoss.apply(x, loss)


@functools.cache
def router_class():
    """megatron-core's `TopKRouter` whose auxiliary losses (load balancing per micro-batch or per
    sequence, z-loss) join backward scaled by the micro-batch's token count (see the module
    docstring) instead of through megatron's process-wide loss scale, and are kept on the router
    (`stats`) instead of megatron's global tracker. `stats` after a forward: `tokens_per_expert`
    [E] (this rank's tokens routed to each expert, fp32, detached) and each aux loss's value
    (without its coefficient). Under sequence parallelism each TP rank routes its share of the
    sequence: `stats` and `load_window` hold this rank's share (`moe_metrics` sums them, z-loss
    averaged, over the TP group in one all-reduce for every router; `replan_experts` the
    window), and each rank's share of an aux loss joins backward at the whole sequence's token
    count. A factory, so that importing this module does not import megatron-core."""
    from megatron.core.transformer.moe.moe_utils import z_loss_func
    from megatron.core.transformer.moe.router import TopKRouter

    class LoadTrackingRouter(TopKRouter):
        def __init__(self, config, pg_collection=None):
            super().__init__(config=config, pg_collection=pg_collection)
            self.stats: dict[str, torch.Tensor] = {}
            self.load_window = None  # tokens routed to each expert since the last replication plan (training)

        def gating(self, input):
            # the router's own dtype (fp32), not autocast's: megatron's gating function computes
            # its backward in that dtype and would meet autocast's bf16 output gradient there
            with torch.autocast(input.device.type, enabled=False):
                return super().gating(input)

        def routing(self, logits, padding_mask=None):
            self.stats = {}
            probs, routing_map = super().routing(logits, padding_mask=padding_mask)
            load = routing_map.detach().sum(0, dtype=torch.float32)
            self.stats["tokens_per_expert"] = load
            if self.training and torch.is_grad_enabled():  # (not again when recompute repeats the forward)
                self.load_window = load.clone() if self.load_window is None else self.load_window + load
            return probs, routing_map

        def attach_and_log_load_balancing_loss(
            self, activation, aux_loss_coeff, aux_loss, aux_loss_name, reduce_group, reduce_group_has_dp=False, valid_token_count=None
        ):
            # (megatron's aux losses count tokens over the TP group: a rank's value is its share)
            self.stats[aux_loss_name] = (aux_loss / aux_loss_coeff).detach().float()
            tokens = valid_token_count if valid_token_count is not None else activation.shape[0]
            if self.config.sequence_parallel:
                tokens = tokens * self.tp_cp_group.size()
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
    `moe/load_max_mean`, the mean over this stage's MoE layers; with expert parallelism also
    `moe/layer{n}/ep_load_max_mean` (the busiest EP rank's tokens over the mean, its experts'
    tokens split evenly over their copies) and `moe/layer{n}/replicas` (hot-expert copies in
    spare slots). Empty for a dense model."""
    out = {}
    ratios = []
    for r, stats in zip(model_routers, stats_over_tp(model_routers)):
        if "tokens_per_expert" not in stats:
            continue
        load = stats["tokens_per_expert"]
        ratio = load.max() / load.mean().clamp(min=1e-12)
        ratios.append(ratio)
        out[f"moe/layer{r.layer_number - 1}/load_max_mean"] = ratio * weight
        placement = getattr(r, "placement", None)
        if placement is not None:  # expert-parallel: tokens per EP rank under the layer's placement
            placement = placement.on(load.device)
            ranks = placement.rank_load_matrix @ (load / placement.copy_counts)
            out[f"moe/layer{r.layer_number - 1}/ep_load_max_mean"] = ranks.max() / ranks.mean().clamp(min=1e-12) * weight
            out[f"moe/layer{r.layer_number - 1}/replicas"] = placement.replicas * weight
        for name, value in stats.items():
            if name != "tokens_per_expert":
                out[f"moe/layer{r.layer_number - 1}/{name}"] = value * weight
    if ratios:
        out["moe/load_max_mean"] = torch.stack(ratios).mean() * weight
    return out


def stats_over_tp(model_routers: list) -> list[dict[str, torch.Tensor]]:
    """Each router's `stats` for the whole sequence: under sequence parallelism summed (z-loss:
    averaged) over the TP ranks sharing it, every router's in one all-reduce; as they are
    otherwise."""
    stats = [dict(r.stats) for r in model_routers]
    keys = [(i, k) for i, r in enumerate(model_routers) if r.config.sequence_parallel for k in stats[i]]
    if not keys:
        return stats
    group = model_routers[keys[0][0]].tp_cp_group
    flat = torch.cat([stats[i][k].reshape(-1) for i, k in keys])
    dist.all_reduce(flat, group=group)
    for (i, k), value in zip(keys, flat.split([stats[i][k].numel() for i, k in keys])):
        value = value.view_as(stats[i][k])
        stats[i][k] = value / group.size() if k == "z_loss" else value
    return stats


def finish_step(model: nn.Module, group) -> None:
    """What a step's end owes the routers once its gradients are final (megatron-core does it in
    its `finalize_model_grads`, which this trainer does not use): the expert-bias update, and the
    global aux loss's token counts (accumulated over the step's micro-batches) restarted."""
    update_expert_biases(model, group)
    for r in routers(model):
        r.reset_global_aux_loss_tracker()


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
    the router probabilities applied as the outputs are combined. Other layouts use the config's
    `moe_token_dispatcher_type`: megatron's all-gather dispatcher (expert parallelism with
    hot-expert replicas, token dropping) or its all-to-all dispatcher (each token sent only to the
    ranks holding its experts; no replicas). A factory, so that importing this module does not
    import megatron-core."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher, MoEAlltoAllTokenDispatcher, MoETokenDispatcher

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

    class PlacedAllGatherDispatcher(MoEAllGatherTokenDispatcher):
        """megatron's all-gather dispatcher (every rank gathers its EP group's tokens, computes
        the pairs of its expert slots, and reduce-scatters the outputs back) where a rank's slots
        are its `PlacedExperts`: its home experts and the replicas of hot experts it holds. Each
        (token, expert) pair goes to exactly one copy of the expert, copy `i % n` for the i-th
        token routed to it, so every pair is computed once."""

        placement: "PlacedExperts" = None

        def dispatch_postprocess(self, hidden_states, probs):
            from megatron.core.transformer.moe.moe_utils import permute

            routed = self.routing_map  # [gathered tokens, experts]
            pl = self.placement.on(routed.device)
            self.hidden_shape_before_permute = hidden_states.shape
            nth = routed.long().cumsum(0) - 1  # which of the expert's tokens each pair is
            copy = nth % pl.copy_counts.long()
            owner = pl.owners.flatten()[torch.arange(routed.shape[1], device=routed.device) * pl.owners.shape[1] + copy]
            self.local_map = (routed & (owner == self.ep_group.rank()))[:, pl.slot_experts].contiguous()
            self.local_probs = probs[:, pl.slot_experts].contiguous()
            tokens_per_expert = self.local_map.sum(dim=0).long().cpu()
            permuted, _, self.reversed_local_input_permutation_mapping = permute(
                hidden_states, self.local_map, num_out_tokens=tokens_per_expert.sum(), fused=False
            )
            self.local_probs = self.local_probs.T.contiguous().masked_select(self.local_map.T.contiguous())
            self.routing_map = None
            return permuted, tokens_per_expert, self.local_probs

    class AlltoAllDispatcher(MoEAlltoAllTokenDispatcher):
        """megatron's all-to-all dispatcher, off CUDA too: megatron's copies the token counts to
        the host on a side CUDA stream and allocates the all-to-all outputs on the current CUDA
        device; here, on other devices, the counts are read where they are needed, and the
        outputs are allocated on the tokens' device. On CUDA the counts keep megatron's stream."""

        def token_dispatch(self, permutated_local_input_tokens, permuted_probs):
            self.tokens_per_expert = self._maybe_dtoh_and_synchronize("before_ep_alltoall", self.tokens_per_expert)
            splits = (self.ep_group, self.output_splits, self.input_splits)
            return _AllToAll.apply(permutated_local_input_tokens, *splits), _AllToAll.apply(permuted_probs, *splits)

        def token_combine(self, hidden_states, async_finish=True, allocate_on_comm_stream=True):
            return _AllToAll.apply(hidden_states, self.ep_group, self.input_splits, self.output_splits)

        def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
            if self.drop_and_pad or self.routing_map.is_cuda:
                return super()._maybe_dtoh_and_synchronize(point, tokens_per_expert)
            if point == self.cuda_dtoh_point:

                def host(t):
                    return t.cpu() if torch.is_tensor(t) else t

                self.input_splits, self.output_splits, self.output_splits_tp = (
                    None if t is None else host(t).tolist() for t in (self.input_splits, self.output_splits, self.output_splits_tp)
                )
                self.num_out_tokens = host(self.num_out_tokens)
                if self.num_local_experts > 1:
                    self.num_global_tokens_per_local_expert = host(self.num_global_tokens_per_local_expert)
                return host(tokens_per_expert)
            return tokens_per_expert

    class OpTableMoELayer(MoELayer):
        def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, ops: OpTable | None = None):
            super().__init__(config, submodules, layer_number, pg_collection)
            from loongforge.core.parallel.expert_placement import home_placement

            if self.num_local_experts == config.num_moe_experts and config.moe_expert_capacity_factor is None:
                self.token_dispatcher = LocalTokenDispatcher(config, pg_collection, ops or OpTable())
            elif config.moe_token_dispatcher_type == "alltoall":
                self.token_dispatcher = AlltoAllDispatcher(self.num_local_experts, self.local_expert_indices, config, pg_collection)
                if self.num_local_experts < config.num_moe_experts:  # (the router's placement: the EP load metrics)
                    self.router.placement = PlacedExperts(
                        home_placement(config.num_moe_experts, self.ep_group.size()), self.ep_group.rank()
                    )
            elif self.num_local_experts < config.num_moe_experts:
                self.token_dispatcher = PlacedAllGatherDispatcher(self.num_local_experts, self.local_expert_indices, config, pg_collection)
                self.set_placement(home_placement(config.num_moe_experts, self.ep_group.size()))

        def set_placement(self, placement) -> None:
            """Hold the experts `placement` (an ExpertPlacement of this layer's EP group) gives
            this rank: its home experts and, in spare slots, copies of hot ones."""
            placed = PlacedExperts(placement, self.ep_group.rank())
            self.token_dispatcher.placement = placed
            self.experts.placement = placed
            self.router.placement = placed

        @property
        def placement(self):
            return getattr(self.token_dispatcher, "placement", None)

    return OpTableMoELayer


class _AllToAll(torch.autograd.Function):
    """All-to-all over `group`, `in_splits[r]` rows of `x` to rank r and `out_splits[r]` rows
    from it (None: even splits), the output on `x`'s device; backward sends the gradients back
    the same way (megatron's `all_to_all`, which allocates its output on the current CUDA device)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, out_splits, in_splits) -> torch.Tensor:
        ctx.group, ctx.splits = group, (in_splits, out_splits)
        if group.size() == 1:
            return x
        x = x.contiguous()
        out = x.new_empty(sum(out_splits), *x.shape[1:]) if out_splits is not None else torch.empty_like(x)
        dist.all_to_all_single(out, x, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllToAll.apply(grad, ctx.group, *ctx.splits), None, None, None


class PlacedExperts:
    """An `ExpertPlacement` as the tensors one rank's MoE layer uses: `slot_experts` [slots] (its
    home experts, then its replicas), `owners` [E, max copies] (each expert's copies' ranks in
    copy order), `copy_counts` [E], `rank_load_matrix` [R, E] (how many of each expert's copies
    a rank holds), and the rows of the replica exchange (see `_ReplicaExchange`). Built on the
    CPU; `on(device)` gives (and keeps) a copy on the device the layer runs on."""

    def __init__(self, placement, rank: int, device=None) -> None:
        e, r = placement.num_experts, placement.ep_size
        self.placement = placement
        self.replicas = float(len(placement.replica_order))
        copies = [placement.copies(x) for x in range(e)]
        width = max(len(c) for c in copies)
        self.owners = torch.tensor([c + [-1] * (width - len(c)) for c in copies], dtype=torch.long, device=device)
        self.copy_counts = torch.tensor([len(c) for c in copies], dtype=torch.float32, device=device)
        self.slot_experts = torch.tensor(placement.slots[rank], dtype=torch.long, device=device)
        held = torch.zeros(r, e, dtype=torch.float32, device=device)
        for rank_, slots in enumerate(placement.slots):
            held[rank_, list(slots)] = 1.0
        self.rank_load_matrix = held
        # the exchange buffer has one row per replica, in replica order: this rank fills the rows
        # of replicas of its home experts and takes the rows of the replicas it holds
        per_rank = e // r
        first = rank * per_rank
        order = placement.replica_order
        self.send_rows = torch.tensor(
            [i for i, (x, _) in enumerate(order) if first <= x < first + per_rank], dtype=torch.long, device=device
        )
        self.send_local = torch.tensor([x - first for x, _ in order if first <= x < first + per_rank], dtype=torch.long, device=device)
        self.recv_rows = torch.tensor([i for i, (_, holder) in enumerate(order) if holder == rank], dtype=torch.long, device=device)
        self._rank = rank
        self._copies: dict = {}

    def on(self, device) -> "PlacedExperts":
        device = torch.device(device)
        if self.copy_counts.device == device:
            return self
        if device not in self._copies:
            self._copies[device] = PlacedExperts(self.placement, self._rank, device)
        return self._copies[device]


class _ReplicaExchange(torch.autograd.Function):
    """The replicas a rank holds, from the home weights of their experts on other ranks (one
    all-reduce over the EP group of a buffer with a row per replica); backward sends each
    replica's gradient back into its home weight's gradient the same way, so the copies of an
    expert train as one weight and the model's math is unchanged."""

    @staticmethod
    def forward(ctx, home: torch.Tensor, placed: PlacedExperts, group) -> torch.Tensor:
        buf = home.new_zeros(len(placed.placement.replica_order), *home.shape[1:])
        buf[placed.send_rows] = home[placed.send_local]
        dist.all_reduce(buf, group=group)
        ctx.placed, ctx.group, ctx.home_shape = placed, group, home.shape
        return buf[placed.recv_rows]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        placed = ctx.placed
        buf = grad.new_zeros(len(placed.placement.replica_order), *grad.shape[1:])
        buf[placed.recv_rows] = grad
        dist.all_reduce(buf, group=ctx.group)
        home_grad = grad.new_zeros(ctx.home_shape)
        home_grad.index_add_(0, placed.send_local, buf[placed.send_rows])
        return home_grad, None, None


def replan_experts(model: nn.Module, group, spare_slots: int, ranks_per_node=None) -> None:
    """Re-plan every expert-parallel MoE layer's hot-expert replicas from the tokens its router
    saw since the last plan, counted over the data-parallel ranks (`group`): the same plan on
    every rank (`plan_replication` is deterministic)."""
    from loongforge.core.parallel.expert_placement import plan_replication

    for m in model.modules():
        placed = getattr(m, "placement", None) if hasattr(m, "set_placement") else None
        if placed is None or m.router.load_window is None:
            continue
        load = m.router.load_window
        if m.router.config.sequence_parallel:  # each TP rank counted its share of the sequence
            dist.all_reduce(load, group=m.router.tp_cp_group)
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(load, group=group)
        m.set_placement(plan_replication(load.double().cpu().numpy(), placed.placement.ep_size, spare_slots, ranks_per_node))
        m.router.load_window = None


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
            self.expt_tp_group = pg_collection.expt_tp
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

        placement = None  # PlacedExperts of an expert-parallel layer (its replicas follow the home experts)

        def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor | None):
            """probs None: the dispatcher applies them when it combines the outputs."""
            fc1, fc2 = self.fc1, self.fc2
            if self.placement is not None and self.placement.replicas:
                placed = self.placement.on(fc1.device)
                fc1 = torch.cat([fc1, _ReplicaExchange.apply(fc1, placed, self.ep_group)])
                fc2 = torch.cat([fc2, _ReplicaExchange.apply(fc2, placed, self.ep_group)])
            out = self.ops.moe_expert_mlp(tokens, tokens_per_expert.to(tokens.device), fc1, fc2, swiglu=self.ops.swiglu)
            return (out if probs is None else out * probs.unsqueeze(-1).to(out.dtype)), None

        def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
            """Each weight as the whole [E, ...] tensor, this rank's EP slice at its expert offset;
            replicated over the expert-data-parallel ranks (expert TP is 1; the EP group may span
            the dense TP ranks)."""
            axis = len(sharded_offsets)
            out = {}
            for name in ("fc1", "fc2"):
                out[prefix + name] = ShardedTensor.from_rank_offsets(
                    prefix + name,
                    getattr(self, name),
                    *sharded_offsets,
                    (axis, self.ep_group.rank(), self.ep_group.size()),
                    replica_id=(0, self.expt_tp_group.rank(), self.expt_dp_group.rank()),
                    prepend_axis_num=axis,
                )
            return out

    return GroupedExperts


def is_expert_param(p: torch.Tensor) -> bool:
    """A routed expert's weight: split over the expert-parallel ranks, its gradient averaged over
    the expert-data-parallel ranks (megatron's `allreduce = False` mark)."""
    return getattr(p, "allreduce", True) is False
