"""Hot-expert replication: copy the most loaded experts of an MoE layer into spare expert slots.

With E experts over R expert-parallel ranks, rank r is home to experts r*E/R .. (r+1)*E/R - 1,
and a rank computes the tokens routed to every expert it holds. Skewed routing makes the rank
of the hottest experts the bottleneck of every step. Each rank may hold `spare_slots` extra
experts; an expert with n copies (its home and n - 1 replicas) has its tokens split over them,
token i of the expert going to copy `i % n` in the order of `ExpertPlacement.copies`, so each
copy computes load / n tokens.

`plan_replication` fills the spare slots greedily from a per-expert load (tokens per expert,
summed over recent steps). From the home placement it repeats:

1. the source is the most loaded rank (ties: lowest rank id);
2. its experts are tried in order of per-copy load load_e / n_e, largest first (ties: lowest
   id), skipping those already held by every rank that has a free slot;
3. the new copy goes to the least loaded rank that has a free slot and does not hold the expert,
   preferring the least loaded such rank on the source's node when its load plus the new share
   load_e / (n_e + 1) stays below the source's load after the split; otherwise the least loaded
   such rank anywhere (ties: lowest rank id);
4. the first of these steps that lowers the maximum rank load is taken, or, when several ranks
   share the maximum, one that leaves fewer ranks at it (without that, two equally hot ranks
   would block each other); when no step qualifies, or no slot is free, planning stops.

Nodes are groups of `ranks_per_node` consecutive ranks (rank // ranks_per_node); traffic inside
a node is cheaper than across nodes. `ranks_per_node=None` puts all ranks on one node.

Limits:
- The plan fits the load it is given: routing that drifts between planning and use loses part
  of the gain, so plan from recent steps and re-plan regularly.
- It only adds copies: home experts never move and a replica is never dropped, so a rank hot
  from many moderately loaded experts gains little. The greedy is a heuristic, not an optimum
  (the problem is a bin packing); it never raises the maximum rank load of the home placement.
- The even split is a model: `i % n` splits an expert's tokens to within one token per copy.
- Every spare slot holds a full copy of an expert's weights, and the copies of an expert train
  as one: their gradients must be summed before the optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
from loongforge.core.errors import UserError

_REL_TOL = 1e-9  # rank loads are float sums: differences below this are rounding, not load


@dataclass(frozen=True)
class ExpertPlacement:
    """Which experts each EP rank holds. `replica_order` lists the replicas as (expert, rank) in
    the order they were added; it fixes the copy order that tokens are dealt over. When not given
    it is taken from `slots` in rank order."""

    num_experts: int
    ep_size: int
    spare_slots: int  # spare slots per rank
    slots: tuple[tuple[int, ...], ...]  # slots[rank]: its home experts in order, then its replicas
    replica_order: tuple[tuple[int, int], ...] = ()

    def __post_init__(self):
        _check_sizes(self.ep_size, self.spare_slots, None)
        if self.num_experts < self.ep_size or self.num_experts % self.ep_size:
            raise UserError(f"num_experts={self.num_experts} must be a positive multiple of ep_size={self.ep_size}")
        object.__setattr__(self, "slots", tuple(tuple(int(e) for e in held) for held in self.slots))
        object.__setattr__(self, "replica_order", tuple((int(e), int(r)) for e, r in self.replica_order))
        self._check_slots()
        held_replicas = [(e, r) for r, held in enumerate(self.slots) for e in held[self.experts_per_rank :]]
        if not self.replica_order:
            object.__setattr__(self, "replica_order", tuple(held_replicas))
        elif sorted(self.replica_order) != sorted(held_replicas):
            raise UserError("replica_order must list exactly the replicas held in slots, as (expert, rank) pairs")

    def _check_slots(self):
        if len(self.slots) != self.ep_size:
            raise UserError(f"slots has {len(self.slots)} ranks, expected ep_size={self.ep_size}")
        capacity = self.experts_per_rank + self.spare_slots
        for rank, held in enumerate(self.slots):
            if held[: self.experts_per_rank] != self.home_experts(rank):
                raise UserError(f"slots[{rank}] must start with its home experts {list(self.home_experts(rank))}")
            if len(held) > capacity:
                raise UserError(f"slots[{rank}] holds {len(held)} experts, more than {capacity} (home + spare_slots)")
            if len(set(held)) != len(held):
                raise UserError(f"slots[{rank}] holds an expert twice")
            if any(not 0 <= e < self.num_experts for e in held):
                raise UserError(f"slots[{rank}] names an expert outside 0..{self.num_experts - 1}")

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ep_size

    def home_experts(self, rank: int) -> tuple[int, ...]:
        first = rank * self.experts_per_rank
        return tuple(range(first, first + self.experts_per_rank))

    def home_rank(self, expert: int) -> int:
        return expert // self.experts_per_rank

    def copies(self, expert: int) -> list[int]:
        """The ranks holding `expert`: its home rank, then its replicas' ranks in the order added."""
        return [self.home_rank(expert)] + [rank for e, rank in self.replica_order if e == expert]

    def copy_counts(self) -> np.ndarray:
        """[E] int: copies of each expert, home included."""
        counts = np.ones(self.num_experts, dtype=np.int64)
        for expert, _ in self.replica_order:
            counts[expert] += 1
        return counts

    def rank_loads(self, load) -> np.ndarray:
        """[R] float: tokens each rank computes when expert e receives load[e] tokens, split
        evenly over its copies."""
        expert_load = np.asarray(load, dtype=np.float64)
        if expert_load.shape != (self.num_experts,):
            raise UserError(f"load has shape {expert_load.shape}, expected ({self.num_experts},)")
        per_copy = expert_load / self.copy_counts()
        ranks = np.repeat(np.arange(self.ep_size), [len(held) for held in self.slots])
        experts = np.fromiter((e for held in self.slots for e in held), dtype=np.int64)
        return np.bincount(ranks, weights=per_copy[experts], minlength=self.ep_size)

    def to_dict(self) -> dict:
        return {
            "num_experts": self.num_experts,
            "ep_size": self.ep_size,
            "spare_slots": self.spare_slots,
            "slots": [list(held) for held in self.slots],
            "replica_order": [list(pair) for pair in self.replica_order],
        }

    @classmethod
    def from_dict(cls, d: dict) -> ExpertPlacement:
        missing = [k for k in ("num_experts", "ep_size", "spare_slots", "slots") if k not in d]
        if missing:
            raise UserError(f"expert placement is missing {', '.join(missing)}")
        return cls(
            num_experts=int(d["num_experts"]),
            ep_size=int(d["ep_size"]),
            spare_slots=int(d["spare_slots"]),
            slots=tuple(tuple(held) for held in d["slots"]),
            replica_order=tuple(tuple(pair) for pair in d.get("replica_order", ())),
        )


def home_placement(num_experts: int, ep_size: int, spare_slots: int = 0) -> ExpertPlacement:
    """Each rank holds its own E/R experts and no replica."""
    _check_sizes(ep_size, spare_slots, None)
    if num_experts < ep_size or num_experts % ep_size:
        raise UserError(f"num_experts={num_experts} must be a positive multiple of ep_size={ep_size}")
    per_rank = num_experts // ep_size
    slots = tuple(tuple(range(r * per_rank, (r + 1) * per_rank)) for r in range(ep_size))
    return ExpertPlacement(num_experts, ep_size, spare_slots, slots)


def imbalance(rank_loads) -> float:
    """Max over mean of the rank loads: 1.0 is perfect balance (and what all-zero loads give)."""
    loads = np.asarray(rank_loads, dtype=np.float64)
    mean = float(loads.mean()) if loads.size else 0.0
    return float(loads.max()) / mean if mean > 0 else 1.0


def plan_replication(load, ep_size: int, spare_slots: int, ranks_per_node: int | None = None) -> ExpertPlacement:
    """Fill the spare slots greedily from per-expert `load` [E] (the rule is in the module
    docstring). Deterministic: the same input gives the same placement."""
    _check_sizes(ep_size, spare_slots, ranks_per_node)
    expert_load = _checked_load(load, ep_size)
    home = home_placement(len(expert_load), ep_size, spare_slots)
    node_size = ranks_per_node or ep_size
    slots = [list(held) for held in home.slots]
    counts = np.ones(len(expert_load), dtype=np.int64)
    replica_order: list[tuple[int, int]] = []
    capacity = home.experts_per_rank + spare_slots
    while expert_load.any() and any(len(held) < capacity for held in slots):
        step = _first_improving_step(expert_load, slots, counts, capacity, node_size)
        if step is None:
            break
        expert, rank = step
        slots[rank].append(expert)
        counts[expert] += 1
        replica_order.append((expert, rank))
    return ExpertPlacement(home.num_experts, ep_size, spare_slots, tuple(map(tuple, slots)), tuple(replica_order))


def _first_improving_step(expert_load, slots, counts, capacity, node_size) -> tuple[int, int] | None:
    """(expert, destination rank) of the first step from the most loaded rank that improves the
    (max load, ranks at max) pair; None when none does."""
    per_copy = expert_load / counts
    loads = _loads(per_copy, slots)
    source = int(np.argmax(loads))
    for expert in sorted(slots[source], key=lambda e: (-per_copy[e], e)):
        destination = _destination(expert, source, loads, expert_load, slots, counts, capacity, node_size)
        if destination is None:
            continue  # already on every rank that has room
        new_per_copy = per_copy.copy()
        new_per_copy[expert] = expert_load[expert] / (counts[expert] + 1)
        new_slots = [held + [expert] if rank == destination else held for rank, held in enumerate(slots)]
        if _improves(loads, _loads(new_per_copy, new_slots)):
            return expert, destination
    return None


def _destination(expert, source, loads, expert_load, slots, counts, capacity, node_size) -> int | None:
    open_ranks = [r for r, held in enumerate(slots) if len(held) < capacity and expert not in held]
    if not open_ranks:
        return None
    new_share = expert_load[expert] / (counts[expert] + 1)
    source_after = loads[source] - expert_load[expert] / counts[expert] + new_share
    same_node = [r for r in open_ranks if r // node_size == source // node_size]
    if same_node:
        nearest = min(same_node, key=lambda r: (loads[r], r))
        if loads[nearest] + new_share < source_after:
            return nearest
    return min(open_ranks, key=lambda r: (loads[r], r))


def _loads(per_copy: np.ndarray, slots: Sequence[Sequence[int]]) -> np.ndarray:
    return np.array([per_copy[list(held)].sum() for held in slots])


def _improves(before: np.ndarray, after: np.ndarray) -> bool:
    """True when `after` has a lower max than `before`, or the same max on fewer ranks."""
    top_before, top_after = before.max(), after.max()
    tol = _REL_TOL * max(top_before, 1.0)
    if top_after < top_before - tol:
        return True
    return bool(top_after <= top_before + tol and np.sum(after >= top_after - tol) < np.sum(before >= top_before - tol))


def _checked_load(load, ep_size: int) -> np.ndarray:
    try:
        expert_load = np.asarray(load, dtype=np.float64)
    except (TypeError, ValueError):
        raise UserError("load must be a list of per-expert token counts") from None
    if expert_load.ndim != 1 or expert_load.size == 0 or expert_load.size % ep_size:
        raise UserError(f"load has {expert_load.size} experts, which must be a positive multiple of ep_size={ep_size}")
    if not np.all(np.isfinite(expert_load)) or np.any(expert_load < 0):
        raise UserError("load must hold finite, non-negative token counts")
    return expert_load


def _check_sizes(ep_size: int, spare_slots: int, ranks_per_node: int | None) -> None:
    if not isinstance(ep_size, (int, np.integer)) or ep_size < 1:
        raise UserError(f"ep_size must be a positive integer, got {ep_size!r}")
    if not isinstance(spare_slots, (int, np.integer)) or spare_slots < 0:
        raise UserError(f"spare_slots must be a non-negative integer, got {spare_slots!r}")
    if ranks_per_node is not None and (not isinstance(ranks_per_node, (int, np.integer)) or ranks_per_node < 1 or ep_size % ranks_per_node):
        raise UserError(f"ranks_per_node={ranks_per_node!r} must be a positive integer dividing ep_size={ep_size}")
