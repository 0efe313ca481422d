"""`ParallelContext`: the process groups and ranks one model component trains with.

megatron-core's `parallel_state` is initialized once per process, for the whole model's layout
(its dist-checkpointing needs it); every module then receives its groups explicitly through
`pg_collection` and the context, and nothing swaps the globals afterwards. Components that run
another layout on the same ranks (a TP=1 vision encoder feeding a TP=2 decoder) get contexts of
their own groups from `component_contexts`.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Mapping, TypeVar

import torch
import torch.distributed as dist
from loongforge.core.errors import UserError

T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ParallelContext:
    """One layout's groups as seen from this rank; sizes and ranks are those of the groups."""

    tp_size: int
    pp_size: int
    dp_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: object
    pp_group: object
    dp_group: object
    mp_group: object  # tensor x pipeline ranks (the global gradient norm)
    embedding_group: object  # first and last pipeline stage (tied embeddings); None at PP=1 and on middle stages
    # Ulysses context parallelism (plain torch models that split attention heads: the diffusion
    # transformers): consecutive ranks of dp_group splitting each micro-batch's tokens; dp_group
    # then holds them (gradients average over it) and dp_size counts them. This rank alone otherwise.
    cp_group: object = None
    pos_embedding_group: object = None  # first pipeline stage; None at PP=1 and on other stages
    # expert parallelism (MoE layers; experts are never tensor-parallel): None without it
    ep_group: object = None  # ranks that split one layer's experts
    expt_dp_group: object = None  # ranks holding the same experts (their gradients are averaged over it)
    expt_mp_group: object = None  # expert x pipeline ranks: the expert gradients' share of the global norm
    # megatron-core's sequence parallelism (TP > 1): activations outside the parallel linears hold
    # 1/TP of the sequence, and the parameters that see them sum their gradients over TP
    sequence_parallel: bool = False
    tp_dp_group: object = None  # tensor x data ranks: token counts of a step (MoE routing under sequence parallelism)

    @property
    def cp_size(self) -> int:
        return dist.get_world_size(self.cp_group)

    @property
    def data_size(self) -> int:
        """Ranks that see different data (the data-parallel group without its CP ranks)."""
        return self.dp_size // self.cp_size

    @property
    def ep_size(self) -> int:
        return 1 if self.ep_group is None else dist.get_world_size(self.ep_group)

    @property
    def expert_dp_group(self):
        """The ranks whose expert gradients are reduced together (the data-parallel group without EP)."""
        return self.dp_group if self.ep_group is None else self.expt_dp_group

    @property
    def expert_mp_group(self):
        """The ranks an expert gradient norm sums over (the model-parallel group without EP)."""
        return self.mp_group if self.ep_group is None else self.expt_mp_group

    @classmethod
    def from_groups(
        cls,
        tp_group,
        pp_group,
        dp_group,
        *,
        mp_group,
        cp_group,
        embedding_group=None,
        pos_embedding_group=None,
        ep_group=None,
        expt_dp_group=None,
        expt_mp_group=None,
        sequence_parallel: bool = False,
        tp_dp_group=None,
    ) -> "ParallelContext":
        """The context of explicit groups (this rank a member of each): sizes and ranks read from them."""
        return cls(
            tp_size=dist.get_world_size(tp_group),
            pp_size=dist.get_world_size(pp_group),
            dp_size=dist.get_world_size(dp_group),
            tp_rank=dist.get_rank(tp_group),
            pp_rank=dist.get_rank(pp_group),
            dp_rank=dist.get_rank(dp_group),
            tp_group=tp_group,
            pp_group=pp_group,
            dp_group=dp_group,
            mp_group=mp_group,
            embedding_group=embedding_group,
            cp_group=cp_group,
            pos_embedding_group=pos_embedding_group,
            ep_group=ep_group,
            expt_dp_group=expt_dp_group,
            expt_mp_group=expt_mp_group,
            sequence_parallel=sequence_parallel and dist.get_world_size(tp_group) > 1,
            tp_dp_group=tp_dp_group,
        )

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def prev_rank(self) -> int:
        return dist.get_global_rank(self.pp_group, self.pp_rank - 1)

    @property
    def next_rank(self) -> int:
        return dist.get_global_rank(self.pp_group, self.pp_rank + 1)

    @cached_property
    def _pgs(self):
        """megatron-core's group collection of this context's groups. With no context parallelism
        the CP variants are the plain groups (cp: this rank alone); without expert groups (EP = 1
        and TP = 1) ep is this rank alone and the expert variants are the dense ones. What the
        dense GPTModel path reads: tp, pp, cp, embd (embeddings, attention, MLP, parallel linears,
        the block's layer offsets); MoE layers read ep, expt_tp (this rank alone: experts are never
        tensor-parallel), tp_ep (the ranks a token dispatcher gathers over: ep, as expert TP is
        1), expt_dp, tp_cp (aux-loss token counts of a sequence split by sequence parallelism) and
        tp_dp_cp (the global aux loss's token counts); megatron's DDP helpers also take dp, dp_cp,
        mp, tp_ep_pp. Left unset: hcp (hierarchical CP), tp_dp_cp in a component context at
        TP > 1, and the distributed-optimizer instance groups."""
        from megatron.core.process_groups_config import ProcessGroupCollection

        tp, dp, mp, one = self.tp_group, self.dp_group, self.mp_group, self.cp_group
        ep = self.ep_group if self.ep_group is not None else one
        tp_dp = dp if self.tp_size == 1 else self.tp_dp_group
        extra = {"tp_dp_cp": tp_dp} if tp_dp is not None else {}
        return ProcessGroupCollection(
            **extra,
            tp=tp,
            pp=self.pp_group,
            mp=mp,
            cp=one,
            tp_cp=tp,
            dp=dp,
            dp_cp=dp,
            intra_dp_cp=dp,
            embd=self.embedding_group,
            pos_embd=self.pos_embedding_group,
            ep=ep,
            expt_tp=one if self.ep_group is not None else tp,
            tp_ep=ep if self.ep_group is not None else tp,
            tp_ep_pp=self.expt_mp_group if self.ep_group is not None else mp,
            expt_dp=self.expt_dp_group if self.ep_group is not None else dp,
            intra_expt_dp=self.expt_dp_group if self.ep_group is not None else dp,
        )

    def pg_collection(self):
        """The groups to pass as megatron-core's `pg_collection` (built once per context)."""
        return self._pgs

    def layout(self) -> dict:
        return {
            "tensor_model_parallel_size": self.tp_size,
            "pipeline_model_parallel_size": self.pp_size,
            "data_parallel_size": self.data_size,
            **({"expert_model_parallel_size": self.ep_size} if self.ep_size > 1 else {}),
            **({"context_parallel_size": self.cp_size} if self.cp_size > 1 else {}),
        }


def init_parallel(
    tp: int, pp: int, backend: str, device_type: str, ep: int = 1, sequence_parallel: bool = False, cp: int = 1
) -> ParallelContext:
    """Join (or create, for a single process) the default process group and lay out TP x PP x DP,
    and for MoE layers EP x expert-DP over the same ranks (experts are not tensor-parallel: each
    pipeline stage's world / PP ranks split into EP groups). `sequence_parallel` (at TP > 1):
    megatron-core's sequence parallelism; the expert groups then exist at EP = 1 too, as a MoE
    layer's TP ranks route different tokens (their expert gradients sum over the expert-DP group).
    `cp`: Ulysses context parallelism for plain torch models (TP x CP x DP, megatron-core's rank
    order; not with PP, EP or sequence parallelism).

    Multi-process runs are started by torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
    """
    from loongforge.core.accelerator import active_accelerator
    from loongforge.core.parallel.distributed import init_process_group

    if active_accelerator() is not None:
        active_accelerator().prepare_megatron()
    from megatron.core import parallel_state as ps

    init_process_group(backend, device_type)
    world = dist.get_world_size()
    if world % (tp * pp):
        raise UserError(f"world size {world} is not divisible by tensor_model_parallel_size*pipeline_model_parallel_size={tp * pp}")
    if cp > 1 and (pp > 1 or ep > 1 or sequence_parallel):
        raise UserError(
            f"parallel.context_parallel_size={cp} on the megatron stack runs with tensor and data parallelism only; "
            "set pipeline_model_parallel_size=1, expert_model_parallel_size=1 and sequence_parallel=false"
        )
    if world % (tp * cp):
        raise UserError(f"world size {world} is not divisible by tensor_model_parallel_size*context_parallel_size={tp * cp}")
    if ep < 1 or world % (ep * pp):
        raise UserError(
            f"parallel.expert_model_parallel_size={ep}: expert_model_parallel_size*pipeline_model_parallel_size={ep * pp} "
            f"does not divide the world size {world}; choose a divisor of {world // pp}"
        )
    if ps.model_parallel_is_initialized():
        have = (
            ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_expert_model_parallel_world_size(),
            ps.get_context_parallel_world_size(),
        )
        if have != (tp, pp, ep, cp):
            raise UserError(
                f"this process already runs TP={have[0]} PP={have[1]} EP={have[2]} CP={have[3]}; "
                f"cannot build a TP={tp} PP={pp} EP={ep} CP={cp} model in it"
            )
    else:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=1,
            context_parallel_size=cp,
        )
    stages = pp > 1
    sequence_parallel = sequence_parallel and tp > 1
    experts = ep > 1 or sequence_parallel
    return ParallelContext.from_groups(
        ps.get_tensor_model_parallel_group(),
        ps.get_pipeline_model_parallel_group(),
        ps.get_data_parallel_group(with_context_parallel=True),
        mp_group=ps.get_model_parallel_group(),
        cp_group=ps.get_context_parallel_group(),
        embedding_group=ps.get_embedding_group(check_initialized=False) if stages else None,
        pos_embedding_group=ps.get_position_embedding_group(check_initialized=False) if stages else None,
        ep_group=ps.get_expert_model_parallel_group() if experts else None,
        expt_dp_group=ps.get_expert_data_parallel_group() if experts else None,
        expt_mp_group=ps.get_expert_tensor_model_pipeline_parallel_group() if experts else None,
        sequence_parallel=sequence_parallel,
        tp_dp_group=ps.get_tensor_and_data_parallel_group() if tp > 1 else None,
    )


def component_contexts(layouts: Mapping[str, tuple[int, int]]) -> dict[str, ParallelContext]:
    """A context per named component, all on every rank of the default group: `layouts` maps a
    name to its (TP, PP); each component's DP is world / (TP * PP). {"vision": (1, 1), "language":
    (2, 1)} on 2 ranks: vision replicated (TP=1, DP=2), language split (TP=2, DP=1); a frozen
    encoder replicated over all ranks is (1, 1).

    Ranks are laid out as megatron-core lays out the whole model (tensor fastest, then data, then
    pipeline: rank = (pp_rank * DP + dp_rank) * TP + tp_rank), so a component at the global layout
    gets the ranks of megatron's groups. Group creation is collective: every rank must call this
    with the same `layouts` (same order); every group of every component is created in the same
    order on all ranks, each distinct rank list once (the world's is the default group)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    made = {tuple(range(world)): dist.group.WORLD}

    def own(rows) -> object:
        """Create (or reuse) a group for every row of ranks; this rank's, or None if in none."""
        mine = None
        for row in rows:
            key = tuple(int(r) for r in row)
            if key not in made:
                made[key] = dist.new_group(list(key))
            if rank in key:
                mine = made[key]
        return mine

    alone = own([[r] for r in range(world)])
    out = {}
    for name, (tp, pp) in layouts.items():
        if tp < 1 or pp < 1 or world % (tp * pp):
            raise UserError(f"component {name!r}: TP={tp} x PP={pp} does not divide the world size {world}")
        dp = world // (tp * pp)
        grid = torch.arange(world).reshape(pp, dp, tp)  # grid[p, d, t] is the global rank
        stages = grid.permute(1, 2, 0).reshape(-1, pp)  # one row per pipeline
        out[name] = ParallelContext.from_groups(
            own(grid.reshape(-1, tp)),
            own(stages),
            own(grid.transpose(1, 2).reshape(-1, dp)),
            mp_group=own(grid.transpose(0, 1).reshape(dp, pp * tp)),
            cp_group=alone,
            embedding_group=own(stages[:, [0, -1]]) if pp > 1 else None,
            pos_embedding_group=own(stages[:, :1]) if pp > 1 else None,
        )
    return out


def validate_components(parallel_cfg, world_size: int, known_components) -> dict[str, tuple[int, int]]:
    """Check `parallel.components` against the model and the world size; return every known
    component's (TP, PP), an override's value where set, else the model's global one. Raises a
    UserError naming the key for an unknown component, a PP > 1 (components run one pipeline
    stage each: no schedule for a pipeline per component exists yet) or a TP * PP that does not
    divide the world size."""
    known = list(known_components)
    overrides = dict(parallel_cfg.components or {})
    for name in overrides:
        if name not in known:
            raise UserError(f"parallel.components.{name}: this model has no component {name!r}; its components are {', '.join(known)}")
    layouts = {}
    for name in known:
        over = overrides.get(name)
        tp, pp = parallel_cfg.tensor_model_parallel_size, parallel_cfg.pipeline_model_parallel_size
        tp_key, pp_key = "parallel.tensor_model_parallel_size", "parallel.pipeline_model_parallel_size"
        if over is not None and over.tensor_model_parallel_size is not None:
            tp, tp_key = over.tensor_model_parallel_size, f"parallel.components.{name}.tensor_model_parallel_size"
        if over is not None and over.pipeline_model_parallel_size is not None:
            pp, pp_key = over.pipeline_model_parallel_size, f"parallel.components.{name}.pipeline_model_parallel_size"
        if pp != 1:
            raise UserError(
                f"{pp_key}={pp}: component {name!r} would run pipeline parallelism, which components do not support yet; "
                f"set parallel.components.{name}.pipeline_model_parallel_size=1"
            )
        if tp < 1 or world_size % tp:
            raise UserError(
                f"{tp_key}={tp} does not divide the world size {world_size}; "
                f"set parallel.components.{name}.tensor_model_parallel_size to a divisor of {world_size}"
            )
        layouts[name] = (tp, pp)
    return layouts


def on_rank0(fn: Callable[[], T]) -> T:
    """Run `fn` on global rank 0 only and return its value on every rank (broadcast; keep it
    small and picklable); every rank raises rank 0's UserError, if it raised one, so no rank is
    left waiting in a collective for a rank that failed."""
    box: list = [None, None]  # [error message, value]
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            box[1] = fn()
        except UserError as e:
            box[0] = str(e)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise UserError(box[0])
    return box[1]


def single_process_context() -> ParallelContext:
    """Whole models (conversion, `load_model`) are built on the CPU, in this process's (or a new
    single-process) group."""
    from loongforge.core.accelerator import get_accelerator

    acc = get_accelerator()
    return init_parallel(1, 1, acc.backend, acc.device_type)
