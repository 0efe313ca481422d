"""Several datasets mixed by weight, as one stream of samples that depends only on the position.

    mix = DatasetMixture([ds_a, ds_b], weights=[0.7, 0.3], seed=0)
    mix.index(n)            # (dataset id, frame index) of the run's n-th sample
    item = mix[n]           # that frame: ds_a[...] or ds_b[...]

The trainer counts samples (`rank_micro_batches` turns a step into sample positions), so a run
resumed at position N draws what the uninterrupted run would, with no sampler state to save.

How positions map to datasets: the stream is cut into rounds of about `round_size` positions.
Through the first r rounds, dataset d has been drawn c_d(r) = floor(p_d * r * round_size + u_d)
times, p_d its share of the weights and u_d in [0, 1) a random phase fixed by (seed, d): each
count is within one draw of its exact share at every round boundary, and a tiny share still
comes up now and then. Round r holds c_d(r + 1) - c_d(r) draws of each d in an order shuffled
by (seed, r), so both where a round starts and what it holds follow from r alone. The k-th draw
of dataset d (k counted from the start of the stream) reads frame perm_{d, k // n_d}[k % n_d]:
each pass over a dataset of n_d frames visits every frame once, in a fresh order per pass.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, Sequence

import numpy as np
from loongforge.core.errors import UserError

_ROUND = 1  # SeedSequence tags: the streams of the round orders, the phases and the pass orders
_PHASE = 2
_PASS = 3


def dataset_name(dataset, i: int) -> str:
    root = getattr(dataset, "root", None)
    return str(root) if root is not None else f"dataset {i}"


class DatasetMixture:
    """`datasets` (each with `len()` and `[frame]`) drawn by `weights` (positive, finite); the
    sample at each position depends only on (seed, position). `round_size` sets how far apart the mix is exact (see the module doc)."""

    def __init__(self, datasets: Sequence, weights: Sequence[float], seed: int = 0, round_size: int = 1024):
        self.datasets = list(datasets)
        if not self.datasets:
            raise UserError("a dataset mixture needs at least one dataset")
        try:
            w = [float(x) for x in weights]
        except (TypeError, ValueError):
            raise UserError(f"mixture weights must be numbers, got {weights!r}") from None
        if len(w) != len(self.datasets):
            raise UserError(f"mixture: {len(w)} weights for {len(self.datasets)} datasets")
        bad = [(i, x) for i, x in enumerate(w) if not (math.isfinite(x) and x > 0)]
        if bad or not math.isfinite(sum(w)):
            which = f" ({dataset_name(self.datasets[bad[0][0]], bad[0][0])}: {bad[0][1]!r})" if bad else " (their sum overflows)"
            raise UserError(f"mixture weights must be positive and finite, got {w}{which}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise UserError(f"mixture seed must be an integer >= 0, got {seed!r}")
        if isinstance(round_size, bool) or not isinstance(round_size, int) or round_size < 1:
            raise UserError(f"mixture round_size must be an integer >= 1, got {round_size!r}")
        self.lengths = [len(ds) for ds in self.datasets]
        for i, n in enumerate(self.lengths):
            if n < 1:
                raise UserError(f"{dataset_name(self.datasets[i], i)}: no frames to draw (an empty dataset in a mixture)")
        self.weights = w
        self.seed = int(seed)
        self.round_size = round_size
        total = sum(w)
        self.shares = np.array([x / total for x in w], dtype=np.float64)
        self._phases = np.random.default_rng(np.random.SeedSequence([self.seed, _PHASE])).random(len(w))
        self._rounds: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._passes: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()

    # ---- the stream
    def counts(self, r: int) -> np.ndarray:
        """Draws of each dataset in the first `r` rounds (int64, one per dataset)."""
        return np.floor(self.shares * float(r * self.round_size) + self._phases).astype(np.int64)

    def round_start(self, r: int) -> int:
        """The position where round `r` starts."""
        return int(self.counts(r).sum())

    def _round_of(self, position: int) -> int:
        r = position // self.round_size  # within a few rounds of the answer: starts drift < len(datasets)
        while self.round_start(r) > position:
            r -= 1
        while self.round_start(r + 1) <= position:
            r += 1
        return r

    def _round(self, r: int) -> tuple[np.ndarray, np.ndarray]:
        """Round r's dataset ids in order, and for each its draw number within its dataset."""
        hit = self._rounds.get(r)
        if hit is not None:
            self._rounds.move_to_end(r)
            return hit
        before, after = self.counts(r), self.counts(r + 1)
        ids = np.repeat(np.arange(len(self.datasets)), after - before)
        np.random.default_rng(np.random.SeedSequence([self.seed, _ROUND, r])).shuffle(ids)
        draws = np.empty(len(ids), dtype=np.int64)
        for d in range(len(self.datasets)):
            where = np.flatnonzero(ids == d)
            draws[where] = before[d] + np.arange(len(where))
        self._rounds[r] = (ids, draws)
        while len(self._rounds) > 4:
            self._rounds.popitem(last=False)
        return ids, draws

    def _frame(self, d: int, draw: int) -> int:
        n = self.lengths[d]
        key = (d, draw // n)
        perm = self._passes.get(key)
        if perm is None:
            perm = np.random.default_rng(np.random.SeedSequence([self.seed, _PASS, d, key[1]])).permutation(n)
            self._passes[key] = perm
            while len(self._passes) > 2 * len(self.datasets):
                self._passes.popitem(last=False)
        else:
            self._passes.move_to_end(key)
        return int(perm[draw % n])

    def index(self, position: int) -> tuple[int, int]:
        """(dataset id, frame index) of the sample at `position` (>= 0)."""
        if isinstance(position, bool) or not isinstance(position, (int, np.integer)) or position < 0:
            raise IndexError(f"mixture position must be an integer >= 0, got {position!r}")
        position = int(position)
        r = self._round_of(position)
        ids, draws = self._round(r)
        k = position - self.round_start(r)
        d = int(ids[k])
        return d, self._frame(d, int(draws[k]))

    def indices(self, start: int, stop: int) -> list[tuple[int, int]]:
        """`index(p)` for p in [start, stop)."""
        return [self.index(p) for p in range(start, stop)]

    def __getitem__(self, position: int) -> Any:
        """The frame at `position`, as its dataset returns it."""
        d, frame = self.index(position)
        return self.datasets[d][frame]

    def __getstate__(self) -> dict:  # picklable for DataLoader workers, without the caches
        return {**self.__dict__, "_rounds": OrderedDict(), "_passes": OrderedDict()}

    def __repr__(self) -> str:
        parts = ", ".join(f"{dataset_name(ds, i)}: {s:.3g}" for i, (ds, s) in enumerate(zip(self.datasets, self.shares)))
        return f"DatasetMixture({parts}; seed={self.seed})"
