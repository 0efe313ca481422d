"""Per-feature normalization of states and actions, as LeRobot 0.4's normalizer defines it.

    norm = Normalizer(dataset.stats, {"observation.state": "MEAN_STD", "action": NormMode.QUANTILES})
    batch = norm.normalize(batch)             # numpy arrays or torch tensors, any leading dims
    actions = norm.unnormalize({"action": predicted})["action"]
    Path("normalizer.json").write_text(json.dumps(norm.state_dict()))  # beside the checkpoint
    norm = Normalizer.from_state_dict(json.loads(Path("normalizer.json").read_text()))  # serving

The modes, with eps = 1e-8 (a zero range d is replaced by eps, so a constant feature maps to -1):

    IDENTITY    x
    MEAN_STD    (x - mean) / (std + eps)          inverse  x * (std + eps) + mean
    MIN_MAX     2 * (x - min) / d - 1, d = max - min      inverse  (x + 1) * d / 2 + min
    QUANTILES   the same with q01 and q99
    QUANTILE10  the same with q10 and q90

A stat broadcasts over the trailing dims of the value (a (6,) stat over (..., 6) states, a (3, 1, 1)
stat over (..., 3, h, w) images). Datasets whose stats lack the quantiles get them from
`compute_stats(dataset, keys)`, which reads every frame's parquet values of those features.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np
from loongforge.core.errors import UserError
from loongforge.embodied.data.parquet_frames import DataFile

EPS = 1e-8
QUANTILES = (0.01, 0.10, 0.50, 0.90, 0.99)
STATE_DICT_FORMAT = 1


class NormMode(str, Enum):
    IDENTITY = "IDENTITY"
    MEAN_STD = "MEAN_STD"
    MIN_MAX = "MIN_MAX"
    QUANTILES = "QUANTILES"
    QUANTILE10 = "QUANTILE10"

    @classmethod
    def parse(cls, value: NormMode | str, feature: str = "") -> NormMode:
        """`value` as a NormMode (names are case-insensitive); a UserError listing the modes."""
        if isinstance(value, NormMode):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        where = f" for {feature!r}" if feature else ""
        raise UserError(f"unknown normalization mode {value!r}{where} (choose from {', '.join(cls.__members__)})")


# The stats each mode reads: (low, high) for the range modes, (mean, std) for MEAN_STD.
REQUIRED_STATS: dict[NormMode, tuple[str, ...]] = {
    NormMode.IDENTITY: (),
    NormMode.MEAN_STD: ("mean", "std"),
    NormMode.MIN_MAX: ("min", "max"),
    NormMode.QUANTILES: ("q01", "q99"),
    NormMode.QUANTILE10: ("q10", "q90"),
}


def _as_numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu().numpy()
    return np.asarray(value, dtype=np.float64)


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


class Normalizer:
    """Normalizes and unnormalizes the features of `modes` ({feature: NormMode or its name}) with
    `stats` ({feature: {stat: array}}, e.g. `LeRobotDataset.stats`). Only the stats each mode needs
    are kept; a missing one is a UserError naming the feature, the stat and the mode."""

    def __init__(self, stats: Mapping[str, Mapping[str, Any]], modes: Mapping[str, NormMode | str], eps: float = EPS):
        self.eps = float(eps)
        self.modes: dict[str, NormMode] = {}
        self.stats: dict[str, dict[str, np.ndarray]] = {}
        for feature, mode in modes.items():
            mode = NormMode.parse(mode, feature)
            needed = REQUIRED_STATS[mode]
            have = stats.get(feature, {}) if needed else {}
            for name in needed:
                if name not in have:
                    lacks = f"dataset stats for {feature!r} lack {name!r}" if have else f"dataset stats have no {feature!r}"
                    raise UserError(
                        f"{lacks} ({mode.value} needs {' and '.join(needed)}); compute them with compute_stats(dataset, [{feature!r}])"
                    )
            kept = {name: _as_numpy(have[name]) for name in needed}
            if not all(np.isfinite(v).all() for v in kept.values()):
                raise UserError(f"dataset stats for {feature!r}: {' or '.join(needed)} is not finite (NaN or inf)")
            if len({v.shape for v in kept.values()}) > 1:
                shapes = ", ".join(f"{name} {list(v.shape)}" for name, v in kept.items())
                raise UserError(f"dataset stats for {feature!r} disagree in shape: {shapes}")
            self.modes[feature] = mode
            self.stats[feature] = kept
        self._cache: dict[tuple, tuple] = {}

    def __getstate__(self) -> dict:  # picklable for DataLoader workers: the per-device copies stay behind
        return {**self.__dict__, "_cache": {}}

    # ---- transforms
    def normalize(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """A copy of `batch` with each feature that has a mode normalized (others as they are)."""
        return self._apply(batch, inverse=False)

    def unnormalize(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """The inverse of `normalize`: a copy of `batch` with those features mapped back."""
        return self._apply(batch, inverse=True)

    def _apply(self, batch: Mapping[str, Any], inverse: bool) -> dict[str, Any]:
        out = dict(batch)
        for feature, mode in self.modes.items():
            if feature in out and mode is not NormMode.IDENTITY:
                out[feature] = self._transform(feature, mode, out[feature], inverse)
        return out

    def _transform(self, feature: str, mode: NormMode, x: Any, inverse: bool) -> Any:
        x, (a, b) = self._params(feature, mode, x)
        if mode is NormMode.MEAN_STD:  # a = mean, b = std + eps
            return x * b + a if inverse else (x - a) / b
        # a = low, b = d (the range, eps where it is 0)
        return (x + 1) * b / 2 + a if inverse else 2 * (x - a) / b - 1

    def _params(self, feature: str, mode: NormMode, x: Any) -> tuple[Any, tuple[Any, Any]]:
        """x in the dtype the transform runs in (its own for float32/float64, else float32, as
        LeRobot's float32 stats promote it), and the mode's two stats in that dtype (and on x's
        device), checked to broadcast over x's trailing dims without growing it. The eps and the
        zero-range test are applied in that dtype, as LeRobot does."""
        if _is_torch(x):
            import torch

            if x.dtype not in (torch.float32, torch.float64):
                x = x.to(torch.float32)
            key = (feature, "torch", x.dtype, x.device)
            convert = lambda v: torch.as_tensor(v, device=x.device).to(x.dtype)  # noqa: E731
            where = torch.where
        else:
            x = np.asarray(x)
            if x.dtype not in (np.float32, np.float64):
                x = x.astype(np.float32)
            key = (feature, "numpy", x.dtype)
            convert = lambda v: np.asarray(v).astype(x.dtype)  # noqa: E731
            where = np.where
        pair = self._cache.get(key)
        if pair is None:
            s = {name: convert(v) for name, v in self.stats[feature].items()}
            eps = convert(self.eps)
            if mode is NormMode.MEAN_STD:
                pair = (s["mean"], s["std"] + eps)
            else:
                low_name, high_name = REQUIRED_STATS[mode]
                d = s[high_name] - s[low_name]
                pair = (s[low_name], where(d == 0, eps, d))
            self._cache[key] = pair
        shape, stat_shape = tuple(x.shape), tuple(np.broadcast_shapes(tuple(pair[0].shape), tuple(pair[1].shape)))
        try:
            fits = np.broadcast_shapes(shape, stat_shape) == shape
        except ValueError:
            fits = False
        if not fits:
            raise UserError(f"{feature!r} has shape {list(shape)}, its stats have shape {list(stat_shape)} (they must match its last dims)")
        return x, pair

    # ---- saving
    def state_dict(self) -> dict:
        """Modes, eps and the stats used, as plain lists and floats (JSON-ready)."""
        return {
            "format": STATE_DICT_FORMAT,
            "eps": self.eps,
            "features": {
                feature: {"mode": mode.value, "stats": {name: v.tolist() for name, v in self.stats[feature].items()}}
                for feature, mode in self.modes.items()
            },
        }

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> Normalizer:
        """The normalizer `state_dict()` describes (no dataset needed)."""
        if not isinstance(state, Mapping) or not isinstance(state.get("features"), Mapping):
            raise UserError("normalizer state: expected {'format', 'eps', 'features': {feature: {'mode', 'stats'}}}")
        if state.get("format") != STATE_DICT_FORMAT:
            raise UserError(f"normalizer state: format {state.get('format')!r} is not supported (expected {STATE_DICT_FORMAT})")
        features = state["features"]
        try:
            modes = {f: d["mode"] for f, d in features.items()}
            stats = {f: d["stats"] for f, d in features.items()}
        except (KeyError, TypeError):
            raise UserError("normalizer state: each feature needs 'mode' and 'stats'") from None
        return cls(stats, modes, eps=state.get("eps", EPS))

    def __repr__(self) -> str:
        return f"Normalizer({', '.join(f'{f}: {m.value}' for f, m in self.modes.items())})"


# ---- computing stats from the data ------------------------------------------------------------


def _stat_keys(dataset, keys: Iterable[str] | None) -> list[str]:
    features = dataset.features
    if keys is None:
        return [k for k, ft in features.items() if ft.get("dtype") not in ("video", "image", "string")]
    keys = [keys] if isinstance(keys, str) else list(keys)
    for key in keys:
        if key not in features:
            raise UserError(f"{dataset.root}: no feature {key!r} to compute stats of (it has: {', '.join(features)})")
        if features[key].get("dtype") in ("video", "image"):
            raise UserError(f"{dataset.root}: {key!r} is a camera; compute_stats reads parquet values only")
    return keys


def compute_stats(dataset, keys: Iterable[str] | None = None) -> dict[str, dict[str, np.ndarray]]:
    """{feature: {mean, std, min, max, count, q01, q10, q50, q90, q99}} over every frame of a
    `LeRobotDataset`, for `keys` (default: every feature that is not a camera or a string).

    Each episode's rows are read from its parquet file as whole columns. Stats have the feature's
    shape (a scalar feature's are of shape (1,), as LeRobot stores them); std is the population
    std (ddof 0); quantiles are exact (numpy's linear interpolation between the two nearest
    values), computed in float64. `count` is the number of frames."""
    keys = _stat_keys(dataset, keys)
    features = dataset.features
    parts: dict[str, list[np.ndarray]] = {k: [] for k in keys}
    by_file: dict[Path, list] = {}
    for i in range(dataset.num_episodes):
        ep = dataset.episode(i)
        by_file.setdefault(ep.data_path, []).append(ep)
    for path, episodes in by_file.items():
        data = DataFile(path, features)
        for key in keys:
            column = data.column(key)
            if not isinstance(column, np.ndarray) or not (np.issubdtype(column.dtype, np.number) or column.dtype == np.bool_):
                raise UserError(f"{path}: column {key!r} is not numeric or has rows of different lengths; it has no stats")
            for ep in episodes:
                if ep.data_row + ep.length > data.num_rows:
                    raise UserError(f"{path} has {data.num_rows} rows, episode {ep.index} needs rows up to {ep.data_row + ep.length - 1}")
                parts[key].append(column[ep.data_row : ep.data_row + ep.length])
    out: dict[str, dict[str, np.ndarray]] = {}
    for key in keys:
        values = np.concatenate(parts[key]).astype(np.float64) if parts[key] else np.zeros((0,))
        n = values.shape[0]
        if n == 0:
            raise UserError(f"{dataset.root}: no frames to compute stats of {key!r} from")
        shape = tuple(features[key].get("shape") or ())
        if int(np.prod(shape, dtype=np.int64)) == values[0].size and shape:
            values = values.reshape((n, *shape))
        elif values.ndim == 1:
            values = values.reshape(n, 1)
        stats = {
            "mean": values.mean(axis=0),
            "std": values.std(axis=0),
            "min": values.min(axis=0),
            "max": values.max(axis=0),
            "count": np.array([n], dtype=np.int64),
        }
        for q, value in zip(QUANTILES, np.quantile(values, QUANTILES, axis=0)):
            stats[f"q{round(q * 100):02d}"] = value
        out[key] = stats
    return out
