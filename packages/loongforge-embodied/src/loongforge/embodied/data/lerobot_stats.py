"""Feature statistics of a LeRobot dataset as numpy arrays: `{feature: {stat: array}}`.

Stats are min/max/mean/std/count (v3.0 may add quantiles such as q01/q99). v2.1 keeps them per
episode only (`meta/episodes_stats.jsonl`), so the dataset's are aggregated here: counts add,
min/max reduce, mean and std combine by the parallel (pooled) variance formula; v3.0 stores them
in `meta/stats.json` and per episode as `stats/<feature>/<stat>` columns of `meta/episodes`.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import numpy as np

Stats = dict[str, dict[str, np.ndarray]]


def stats_to_numpy(stats: Mapping[str, Mapping[str, Any]]) -> Stats:
    """`{feature: {stat: value}}` with every value as an at-least-1-d numpy array."""
    return {feature: {name: np.atleast_1d(np.asarray(value)) for name, value in d.items()} for feature, d in stats.items()}


def stats_from_columns(row: Mapping[str, Any], prefix: str = "stats/") -> Stats:
    """Nest `{"stats/<feature>/<stat>": value}` (v3.0 episode columns) as `{feature: {stat: array}}`."""
    nested: dict[str, dict[str, Any]] = {}
    for key, value in row.items():
        if not key.startswith(prefix) or value is None:
            continue
        feature, _, name = key[len(prefix) :].rpartition("/")
        if feature:
            nested.setdefault(feature, {})[name] = value
    return stats_to_numpy(nested)


def aggregate_stats(per_episode: Iterable[Stats]) -> Stats:
    """The stats of the union of episodes, from each one's min/max/mean/std/count."""
    by_feature: dict[str, list[dict[str, np.ndarray]]] = {}
    for stats in per_episode:
        for feature, d in stats.items():
            by_feature.setdefault(feature, []).append(d)
    out: Stats = {}
    for feature, parts in by_feature.items():
        if not all({"mean", "std", "count"} <= d.keys() for d in parts):
            continue
        means = np.stack([np.asarray(d["mean"], dtype=np.float64) for d in parts])
        variances = np.stack([np.asarray(d["std"], dtype=np.float64) ** 2 for d in parts])
        counts = np.stack([np.asarray(d["count"], dtype=np.float64) for d in parts])
        total = counts.sum(axis=0)
        weights = counts.reshape(counts.shape + (1,) * (means.ndim - counts.ndim))
        mean = (means * weights).sum(axis=0) / total
        variance = ((variances + (means - mean) ** 2) * weights).sum(axis=0) / total
        agg = {"mean": mean, "std": np.sqrt(variance), "count": total.astype(np.int64)}
        if all("min" in d for d in parts):
            agg["min"] = np.min(np.stack([d["min"] for d in parts]), axis=0)
        if all("max" in d for d in parts):
            agg["max"] = np.max(np.stack([d["max"] for d in parts]), axis=0)
        out[feature] = agg
    return out
