"""Camera frames decoded with PyAV: frame-exact reads from video files, and encoded images.

`VideoFile.frame_at(t)` returns the frame whose presentation time (pts * time_base) is within
half a frame period of `t` seconds, as uint8 HWC RGB. It seeks to the keyframe at or before `t`
and decodes forward; reads that go forward by less than `forward_s` keep decoding from where the
last one stopped instead of seeking again, and the last few frames returned are kept, so reading
an episode in order, or a window of neighbouring frames, decodes each frame about once.

A container's demuxer may place a seek on a keyframe whose decode time is before `t` but whose
presentation time is after it (B-frames): the first frame decoded then overshoots `t`, and the
seek is retried from further back.
"""

from __future__ import annotations

import io
from collections import OrderedDict
from pathlib import Path

import av
import numpy as np
from loongforge.core.errors import UserError

RECENT_FRAMES = 8


class VideoFile:
    """One open video file (its first video stream) read by timestamp."""

    def __init__(self, path: Path, fps: float, forward_s: float = 2.0):
        if not Path(path).is_file():
            raise UserError(f"{path} not found (camera video)")
        try:
            self._container = av.open(str(path))
        except av.error.FFmpegError as e:
            raise UserError(f"{path}: cannot open as video: {e}") from None
        if not self._container.streams.video:
            self._container.close()
            raise UserError(f"{path} has no video stream")
        self.path = Path(path)
        self.fps = float(fps)
        self.forward_s = forward_s
        self._stream = self._container.streams.video[0]
        self._time_base = self._stream.time_base
        self._frames = None  # decode iterator, positioned after `_last_ts`
        self._last_ts: float | None = None
        self._recent: OrderedDict[float, np.ndarray] = OrderedDict()

    @property
    def half_period(self) -> float:
        return 0.5 / self.fps

    def close(self) -> None:
        self._frames = None
        self._container.close()

    def frame_at(self, t: float) -> np.ndarray:
        """The frame shown at `t` seconds (uint8, H x W x 3, RGB); a UserError if none is within
        half a frame period of it."""
        half = self.half_period
        for ts, image in self._recent.items():
            if abs(ts - t) < half:
                return image.copy()
        resume = self._frames is not None and self._last_ts is not None and self._last_ts < t - half <= self._last_ts + self.forward_s
        if resume:
            found = self._decode_until(t)
            if found is not None:
                return found.copy()
        margin = 0.0
        while True:
            start = max(0.0, t - half - margin)
            self._seek(start)
            found, first_ts = self._decode_until(t, report_first=True)
            if found is not None:
                return found.copy()
            # the first frame after the seek is already past t: the seek landed too late
            if first_ts is not None and first_ts > t - half and start > 0.0:
                margin = max(2 * margin, 1.0)
                continue
            nearest = "no frame at or after it" if first_ts is None else f"the nearest decoded frame is at {self._last_ts:.4f} s"
            raise UserError(f"{self.path}: no video frame within {half:.4f} s of t={t:.4f} s ({nearest})")

    def _seek(self, t: float) -> None:
        self._container.seek(int(t / self._time_base), stream=self._stream, backward=True, any_frame=False)
        self._frames = self._container.decode(self._stream)
        self._last_ts = None

    def _decode_until(self, t: float, report_first: bool = False):
        """Decode forward to the frame at `t`: that frame, or None once past it or at the end;
        with `report_first`, also the time of the first frame decoded (None if none was)."""
        half = self.half_period
        first_ts = None
        found = None
        for frame in self._frames:
            if frame.pts is None:
                continue
            ts = float(frame.pts * self._time_base)
            first_ts = ts if first_ts is None else first_ts
            self._last_ts = ts
            if ts <= t - half:
                continue
            if ts < t + half:
                found = frame.to_ndarray(format="rgb24")
                self._recent[ts] = found
                while len(self._recent) > RECENT_FRAMES:
                    self._recent.popitem(last=False)
            break
        else:
            self._frames = None  # at the end: the next read seeks
        return (found, first_ts) if report_first else found


def decode_image(value, root: Path, key: str) -> np.ndarray:
    """An `image` feature's cell ({"bytes", "path"}, as `datasets.Image` stores it) as uint8 HWC RGB."""
    data = value.get("bytes") if isinstance(value, dict) else value
    source = None
    if data:
        source = io.BytesIO(data)
    elif isinstance(value, dict) and value.get("path"):
        path = Path(value["path"])
        source = str(path if path.is_absolute() else root / path)
    if source is None:
        raise UserError(f"image feature {key!r}: a row has neither bytes nor a path")
    try:
        with av.open(source) as container:
            return next(container.decode(video=0)).to_ndarray(format="rgb24")
    except (av.error.FFmpegError, StopIteration) as e:
        raise UserError(f"image feature {key!r}: cannot decode {source if isinstance(source, str) else 'its bytes'}: {e}") from None
