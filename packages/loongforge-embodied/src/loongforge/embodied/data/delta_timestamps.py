"""LeRobot's `delta_timestamps`: per feature, time offsets (s) from the current frame.

Each offset must be a whole number of frames (a multiple of 1/fps within `tolerance_s`, 1e-4 s by
default, as LeRobot checks); it becomes a frame delta. The frames read are clamped to the current
frame's episode, and `<key>_is_pad` marks the offsets that fell outside it.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import numpy as np
from loongforge.core.errors import UserError

DEFAULT_TOLERANCE_S = 1e-4


def to_frame_deltas(
    delta_timestamps: Mapping[str, Sequence[float]],
    fps: float,
    known: Iterable[str] | None = None,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
) -> dict[str, np.ndarray]:
    """`{key: offsets in s}` as `{key: int64 frame deltas}`; a UserError naming the key for an
    unknown key (when `known` is given), an empty or non-numeric list, or an offset that is not a
    multiple of 1/fps."""
    if not isinstance(delta_timestamps, Mapping):
        raise UserError(f"delta_timestamps must map feature names to lists of offsets in seconds, got {type(delta_timestamps).__name__}")
    known = None if known is None else list(known)
    out = {}
    for key, offsets in delta_timestamps.items():
        if known is not None and key not in known:
            raise UserError(f"delta_timestamps: unknown feature {key!r} (this dataset has: {', '.join(known)})")
        try:
            seconds = np.asarray(offsets, dtype=np.float64)
        except (TypeError, ValueError):
            raise UserError(f"delta_timestamps[{key!r}]: expected a list of offsets in seconds, got {offsets!r}") from None
        if seconds.ndim != 1 or seconds.size == 0 or not np.isfinite(seconds).all():
            raise UserError(f"delta_timestamps[{key!r}]: expected a non-empty list of finite offsets in seconds, got {offsets!r}")
        frames = np.round(seconds * fps)
        off = np.abs(seconds * fps - frames) / fps > tolerance_s
        if off.any():
            raise UserError(
                f"delta_timestamps[{key!r}]: {seconds[off].tolist()} not multiples of 1/fps = {1 / fps:g} s "
                f"(within {tolerance_s:g} s); use whole frames, e.g. {(frames[off] / fps).tolist()}"
            )
        out[key] = frames.astype(np.int64)
    return out


def window_rows(index: int, start: int, stop: int, deltas: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(frame indices clamped to [start, stop), is_pad) for frame `index` of episode [start, stop)."""
    wanted = index + deltas
    return np.clip(wanted, start, stop - 1), (wanted < start) | (wanted >= stop)
