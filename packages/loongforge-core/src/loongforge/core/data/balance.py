"""Data-parallel load balancing: which samples of a global batch each DP rank trains on, so that
the ranks finish a step together when samples differ widely in cost (a 256-token image beside a
30k-token video). Contiguous or round-robin splits leave every rank waiting for the one that
drew the long videos.

    model = SampleCost.fit(observations)             # or SampleCost(llm_linear=..., ...)
    cost = lambda i: model.cost(*lengths(i))         # lengths(i) = (llm_tokens, vision_patches)
    mine = balanced_rank_samples(step, global_batch, dp_rank, dp_size, cost)
    micro_batches = [mine[k : k + micro_batch] for k in range(0, len(mine), micro_batch)]

Cost model (`SampleCost`): a sample costs, for each component, a * sum(len_i^2) + b * sum(len_i)
over that component's attention segments, plus a constant:

    cost = llm_quadratic * T^2 + llm_linear * T
         + vit_quadratic * sum(p_i^2) + vit_linear * sum(p_i) + constant

T is the sample's LLM token count (its own attention segment in a packed THD batch) and p_i the
patch count of each of its vision attention segments: one per image, and for a video what the
encoder attends over at once (the whole video, or each group of frames for an encoder such as
Qwen2.5-VL's whose full-attention layers attend within a frame group). The quadratic terms are
attention, the linear ones the GEMMs (and windowed attention, whose cost per patch is constant:
a ViT with mostly windowed layers fits a small `vit_quadratic`). Units: coefficients are in
seconds per token^2 / token / patch^2 / patch / sample when fitted from step times measured in
seconds (`fit`), so `cost` is seconds; any consistent unit works (the simulator uses FLOPs),
since balancing only compares costs.

Assignment (`assign`): longest processing time first (samples by descending cost, each to the
currently cheapest rank, ties by the lower rank index), then refinement: while one exchange
between the most loaded rank and another rank (moving one sample, or swapping two) lowers the
most loaded rank's cost without the other rank reaching it, the exchange that lowers it most is
made. With `per_rank` every rank gets exactly that many samples (the trainer needs the same
number of micro-batches on every rank): LPT only fills ranks with room, and refinement only
swaps. Deterministic (no randomness, no set or hash order): every rank computes the whole
assignment from the global batch's costs and takes its own share, with no communication.

Limits:
- Balance is bounded below by the heaviest samples: no split of a batch whose longest video costs
  more than the mean per-rank load beats max(cost) / mean, and with `per_rank` its rank also
  carries per_rank - 1 other samples (`imbalance_lower_bound` computes these bounds and tighter
  ones). With few samples per rank a 32k-token video alone can cost more than the mean per-rank
  load; larger global batches (more samples per rank) make a 1.05 max/mean reachable
  (tools/benchmarks/vlm_balance_sim.py: 32 samples per rank reach it on every simulated batch,
  8 per rank almost never can).
- A heuristic: LPT with pairwise exchanges is not always optimal (on small random sets it
  sometimes misses the optimum by a sample).
- The result is as good as the cost model: fit it from the run's own step times.
- Balanced per step, not per micro-batch: each rank's share comes in descending cost order, so
  micro-batch m of every rank holds samples of similar rank in cost (what FSDP's per-micro-batch
  all-gathers and pipeline schedules run in lockstep on), but the micro-batches are not balanced
  one by one.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np
from loongforge.core.errors import UserError

# (samples a rank ran, measured seconds); each sample is (llm_tokens, vision_patches)
Observation = tuple[Sequence[tuple[int, Sequence[int]]], float]

_FIELDS = ("llm_quadratic", "llm_linear", "vit_quadratic", "vit_linear", "constant")


def _features(llm_tokens: int, vision_patches: Sequence[int]) -> tuple[int, int, int, int, int]:
    """(T^2, T, sum p_i^2, sum p_i, 1), exact in Python integers."""
    t = int(llm_tokens)
    patches = [int(p) for p in vision_patches]
    if t < 0 or any(p < 0 for p in patches):
        raise ValueError(f"lengths must be non-negative, got llm_tokens={llm_tokens}, vision_patches={list(vision_patches)}")
    return t * t, t, sum(p * p for p in patches), sum(patches), 1


@dataclass(frozen=True)
class SampleCost:
    """Per-sample cost, a * sum(len^2) + b * sum(len) per component plus a constant (units in the
    module docstring: seconds per token^2, token, patch^2, patch and sample when fitted)."""

    llm_quadratic: float = 0.0  # per LLM token^2 (attention)
    llm_linear: float = 0.0  # per LLM token (GEMMs)
    vit_quadratic: float = 0.0  # per patch^2 of each vision attention segment
    vit_linear: float = 0.0  # per vision patch (GEMMs, windowed attention)
    constant: float = 0.0  # per sample

    def cost(self, llm_tokens: int, vision_patches: Sequence[int] = ()) -> float:
        """The cost of one sample of `llm_tokens` LLM tokens and one vision attention segment of
        each of `vision_patches` patches (empty for a text-only sample)."""
        coef = (self.llm_quadratic, self.llm_linear, self.vit_quadratic, self.vit_linear, self.constant)
        return math.fsum(c * f for c, f in zip(coef, _features(llm_tokens, vision_patches)))

    @classmethod
    def fit(cls, observations: Iterable[Observation]) -> SampleCost:
        """Non-negative least squares from measured times. Each observation is the samples one
        rank (or one micro-batch) ran, as (llm_tokens, vision_patches) pairs, and the seconds it
        took (forward + backward of those samples; a fixed per-step overhead such as the
        optimizer step should be left out, or it is spread into the per-sample terms). A
        component absent from every observation (no vision patches) gets zero coefficients, as
        does a term the data cannot support. Needs observations that vary in length: the
        quadratic and linear terms are told apart by samples of different lengths."""
        rows, times = [], []
        for samples, seconds in observations:
            feats = [_features(t, p) for t, p in samples]
            rows.append([float(sum(col)) for col in zip(*feats)] if feats else [0.0] * len(_FIELDS))
            times.append(float(seconds))
        if not rows:
            raise ValueError("fit needs at least one observation")
        y = np.asarray(times, dtype=np.float64)
        if not np.all(np.isfinite(y)) or np.any(y < 0):
            raise ValueError("measured times must be finite and non-negative")
        return cls(*(float(c) for c in _nnls(np.asarray(rows, dtype=np.float64), y)))


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin ||x w - y|| over w >= 0, exactly, for a handful of columns: the optimum is the
    unconstrained least-squares solution on its own support (and some optimum has linearly
    independent support columns), so the best feasible least-squares solution over all column
    subsets is optimal. 2^5 small solves; columns are scaled to unit norm first (their raw
    magnitudes span T^2 ~ 1e9 to 1)."""
    scale = np.linalg.norm(x, axis=0)
    live = [j for j in range(x.shape[1]) if scale[j] > 0]
    xs = x[:, live] / scale[live]
    best_w, best_res = np.zeros(len(live)), float(np.dot(y, y))
    for k in range(1, len(live) + 1):
        for subset in itertools.combinations(range(len(live)), k):
            cols = list(subset)
            w_s = np.linalg.lstsq(xs[:, cols], y, rcond=None)[0]
            if np.any(w_s < 0):
                continue
            r = y - xs[:, cols] @ w_s
            res = float(np.dot(r, r))
            if res < best_res:
                best_w, best_res = np.zeros(len(live)), res
                best_w[cols] = w_s
    w = np.zeros(x.shape[1])
    w[live] = best_w / scale[live]
    return w


def _checked_costs(costs: Sequence[float]) -> list[float]:
    c = [float(v) for v in costs]
    if any(not math.isfinite(v) or v < 0 for v in c):
        raise ValueError("costs must be finite and non-negative")
    return c


def assign(costs: Sequence[float], ranks: int, per_rank: int | None = None) -> list[list[int]]:
    """Sample indices per rank (each rank's in descending cost, ties by index): longest
    processing time first, then refinement (the rules are in the module docstring). With
    `per_rank`, every rank gets exactly `per_rank` samples (len(costs) must be ranks * per_rank).
    Deterministic: the same costs give the same assignment in every process."""
    c = _checked_costs(costs)
    if ranks < 1:
        raise ValueError(f"ranks must be at least 1, got {ranks}")
    if per_rank is not None and (per_rank < 0 or per_rank * ranks != len(c)):
        raise ValueError(f"{len(c)} samples cannot give {ranks} ranks {per_rank} samples each")
    shares: list[list[int]] = [[] for _ in range(ranks)]
    room = [(0.0, r) for r in range(ranks)]  # (load, rank): a valid heap as it stands
    for i in sorted(range(len(c)), key=lambda i: (-c[i], i)):
        load, r = heapq.heappop(room)
        shares[r].append(i)
        if per_rank is None or len(shares[r]) < per_rank:
            heapq.heappush(room, (load + c[i], r))
    _refine(c, shares, moves=per_rank is None)
    return [sorted(s, key=lambda i: (-c[i], i)) for s in shares]


def _refine(c: list[float], shares: list[list[int]], moves: bool) -> None:
    """Exchanges between the most loaded rank and another while they lower its load and leave
    the other below its old load; each strictly lowers the sorted load vector, so this ends (the
    round cap only bounds the time)."""
    ranks = len(shares)
    if ranks < 2:
        return
    cost = np.asarray(c, dtype=np.float64)
    loads = [math.fsum(c[i] for i in s) for s in shares]
    for _ in range(4 * len(c) + ranks):
        hi = min(range(ranks), key=lambda r: (-loads[r], r))
        best = None  # (reduction of hi's load, partner, item of hi, item of partner or None)
        mine = cost[shares[hi]]
        for p in sorted(range(ranks), key=lambda r: (loads[r], r)):
            gap = loads[hi] - loads[p]
            if gap <= 0 or (best is not None and gap / 2 <= best[0]):
                break  # no partner further on can lower hi more
            # shifting d from hi to p leaves the pair's larger load at loads[hi] - min(d, gap - d)
            if moves and len(mine):
                gain = np.minimum(mine, gap - mine)
                a = int(np.argmax(gain))
                if gain[a] > 0 and (best is None or gain[a] > best[0]):
                    best = (float(gain[a]), p, a, None)
            theirs = cost[shares[p]]
            if len(mine) and len(theirs):
                d = mine[:, None] - theirs[None, :]
                gain = np.minimum(d, gap - d)
                a, b = divmod(int(np.argmax(gain)), len(theirs))
                if gain[a, b] > 0 and (best is None or gain[a, b] > best[0]):
                    best = (float(gain[a, b]), p, a, b)
        if best is None:
            return
        _, p, a, b = best
        if b is None:
            shares[p].append(shares[hi].pop(a))
        else:
            shares[hi][a], shares[p][b] = shares[p][b], shares[hi][a]
        loads[hi] = math.fsum(c[i] for i in shares[hi])
        loads[p] = math.fsum(c[i] for i in shares[p])


def imbalance(costs: Sequence[float], assignment: Sequence[Sequence[int]]) -> float:
    """Max over mean of the per-rank costs of `assignment` (1.0 is perfect balance, and what
    all-zero costs give)."""
    c = _checked_costs(costs)
    loads = [math.fsum(c[i] for i in share) for share in assignment]
    mean = math.fsum(loads) / len(loads) if loads else 0.0
    return max(loads) / mean if mean > 0 else 1.0


def imbalance_lower_bound(costs: Sequence[float], ranks: int, per_rank: int | None = None) -> float:
    """No assignment of `costs` to `ranks` ranks has a smaller max/mean. Three bounds, the
    largest is returned (loads below are a rank's cost; the mean is total / ranks):
    - some rank costs at least the mean;
    - for k = 0, 1, ...: of the k * ranks + 1 heaviest samples some rank holds k + 1, so it costs
      at least the k + 1 cheapest of those, and with `per_rank` also the per_rank - k - 1
      cheapest of the rest (k = 0: the heaviest sample's rank);
    - with `per_rank`, for j = 1, 2, ...: the q ranks that hold the j heaviest samples hold
      q * per_rank samples in all, so one of them costs at least (those j + the q * per_rank - j
      cheapest others) / q, whatever q is (the minimum over the possible q is taken)."""
    c = _checked_costs(costs)
    n = len(c)
    if ranks < 1:
        raise ValueError(f"ranks must be at least 1, got {ranks}")
    if per_rank is not None and (per_rank < 0 or per_rank * ranks != n):
        raise ValueError(f"{n} samples cannot give {ranks} ranks {per_rank} samples each")
    mean = math.fsum(c) / ranks
    if mean <= 0:
        return 1.0
    desc = sorted(c, reverse=True)
    head = [0.0, *itertools.accumulate(desc)]  # head[j]: the j heaviest
    tail = [*reversed(list(itertools.accumulate(reversed(desc)))), 0.0]  # tail[i]: sum(desc[i:])

    def cheapest(m: int) -> float:  # the m cheapest of all
        return tail[n - m] if m > 0 else 0.0

    best = mean
    k = 0
    while k * ranks + 1 <= n and (per_rank is None or k < per_rank):
        top = k * ranks + 1
        load = head[top] - head[top - k - 1]
        if per_rank is not None and per_rank - k - 1 > 0:
            load += cheapest(per_rank - k - 1)  # the cheapest overall lie outside the top ones
        best = max(best, load)
        k += 1
    if per_rank is not None:
        for j in range(1, n + 1):
            low = min((head[j] + cheapest(q * per_rank - j)) / q for q in range(-(-j // per_rank), min(j, ranks) + 1))
            best = max(best, low)
    return best / mean


def balanced_rank_samples(step: int, global_batch: int, dp_rank: int, dp_size: int, sample_cost: Callable[[int], float]) -> list[int]:
    """Indices (into the run's sample order, `step * global_batch` onwards: the global batch
    `rank_micro_batches` splits) this rank trains on at `step`, global_batch // dp_size of them,
    chosen by `assign` from `sample_cost(index)` of every sample of the global batch; in
    descending cost order (cut it into micro-batches as it comes). Every rank calls it with the
    same arguments but its rank and gets its own share of one assignment, without
    communication; the result depends only on the step (a resumed run trains on what the
    uninterrupted one would)."""
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} is not a rank of a data-parallel group of {dp_size}")
    if global_batch < 1 or global_batch % dp_size:
        raise UserError(f"global batch size {global_batch} is not a positive multiple of the data-parallel size {dp_size}")
    base = step * global_batch
    costs = [sample_cost(base + j) for j in range(global_batch)]
    return [base + j for j in assign(costs, dp_size, global_batch // dp_size)[dp_rank]]
