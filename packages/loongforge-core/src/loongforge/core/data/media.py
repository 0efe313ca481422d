"""Reading videos (PyAV) and images (PIL) as uint8 RGB frames, without torchvision; shared by the
modalities that train on media (diffusion, vlm).

`read_video(source, num_frames, fps)` samples the first video stream at `fps` frames per second
from its first frame: sample k is the frame shown at time t0 + k / fps (t0: the first frame's
presentation time), i.e. the last frame whose presentation time is at or before it, for as long
as that time is before the end of the last frame (its time plus its duration). `fps=None` takes
every frame. The first `num_frames` samples are returned; a video with fewer is a `BadMedia` of
reason "too_short". `decode_frames` returns as many as there are, up to a limit. `uniform_frames`
spreads a fixed count over the whole video (frame indices `uniform_indices`), converting only the
frames it keeps. A missing file is "missing"; a file (or bytes) that does not open or decode as a
video (or image) is "corrupt".

A source is a file path, or the file's bytes (as parquet datasets hold images). PyAV and Pillow
are imported inside the functions: the packages that call them declare them (`av`, `pillow`).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Union

import numpy as np
from loongforge.core.errors import UserError

REASONS = ("missing", "corrupt", "too_short")

MediaSource = Union[str, Path, bytes]


class BadMedia(UserError):
    """A media file that cannot be used: `reason` is one of REASONS, the message names the file."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


def describe(source: MediaSource) -> str:
    """How messages name a source: its path, or `<N bytes>`."""
    return f"<{len(source)} bytes>" if isinstance(source, (bytes, bytearray, memoryview)) else str(source)


def _open_source(source: MediaSource):
    """A path (checked to exist) or a binary stream over the bytes."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return io.BytesIO(bytes(source))
    path = Path(source)
    if not path.is_file():
        raise BadMedia("missing", f"{path}: file not found")
    return path


def decode_frames(source: MediaSource, limit: int | None, fps: float | None) -> np.ndarray:
    """Up to `limit` frames (None: all) sampled as `read_video` does, uint8 [n, H, W, 3]; n may
    be smaller than `limit`. BadMedia "missing" or "corrupt" (a video with no frame is corrupt)."""
    import av

    opened = _open_source(source)
    name = describe(source)
    if fps is not None and not fps > 0:
        raise ValueError(f"fps must be positive or None, got {fps}")
    out: list[np.ndarray] = []
    try:
        with av.open(opened if isinstance(opened, io.BytesIO) else str(opened)) as container:
            if not container.streams.video:
                raise BadMedia("corrupt", f"{name}: no video stream")
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            if fps is None:
                for frame in container.decode(stream):
                    if limit is not None and len(out) >= limit:
                        break
                    out.append(frame.to_ndarray(format="rgb24"))
            else:
                _sample(container, stream, limit, float(fps), out)
    except BadMedia:
        raise
    except (av.error.FFmpegError, ValueError, OSError) as e:
        if not out:
            raise BadMedia("corrupt", f"{name}: cannot decode as video: {e}") from None
        # a damaged tail: keep the frames decoded before it (they are whole frames)
    if not out:
        raise BadMedia("corrupt", f"{name}: no video frame decoded")
    return np.stack(out)


def _sample(container, stream, limit: int | None, fps: float, out: list[np.ndarray]) -> None:
    """Append the frames shown at t0 + k / fps, k = 0, 1, ... (see the module docstring)."""
    time_base = stream.time_base
    default_duration = 1.0 / float(stream.average_rate) if stream.average_rate else 0.0
    t0 = None
    k = 0
    prev = None  # (time, frame) of the last frame decoded
    prev_image = None
    dur = default_duration

    def emit_until(t_next: float) -> bool:
        """Emit the previous frame for every sample time before `t_next`; False once `limit` is reached."""
        nonlocal k, prev_image
        while limit is None or len(out) < limit:
            target = t0 + k / fps
            if target >= t_next - 1e-9:
                return True
            if prev_image is None:
                prev_image = prev[1].to_ndarray(format="rgb24")
            out.append(prev_image)
            k += 1
        return False

    for frame in container.decode(stream):
        if frame.pts is None and frame.time is None:
            continue
        ts = float(frame.time) if frame.time is not None else float(frame.pts * time_base)
        if t0 is None:
            t0 = ts
        if prev is not None and not emit_until(ts):
            return
        prev, prev_image = (ts, frame), None
        dur = float(frame.duration * time_base) if frame.duration else default_duration
    if prev is not None:
        emit_until(prev[0] + (dur if dur > 0 else 1e-6))


def uniform_indices(total: int, count: int) -> np.ndarray:
    """`count` frame indices spread uniformly over `total` frames, `arange(count) * total // count`
    (transformers' `default_sample_indices_fn` with num_frames=count); with fewer frames than
    `count` some repeat."""
    return np.arange(count, dtype=np.int64) * total // count


def uniform_frames(source: MediaSource, count: int) -> np.ndarray:
    """`count` frames at `uniform_indices` of the video's frames (in presentation order), uint8
    [count, H, W, 3]. The frame count comes from the container (or by reading its packets, which
    decodes nothing); only the kept frames are converted to RGB, so a long video costs `count`
    frames of memory. Should decoding give another count (a damaged tail), it samples again over
    the frames that decode. BadMedia "missing" or "corrupt" as `decode_frames`."""
    import av

    if count < 1:
        raise ValueError(f"count must be positive, got {count}")
    name = describe(source)

    def run(pass_fn):
        opened = _open_source(source)
        with av.open(opened if isinstance(opened, io.BytesIO) else str(opened)) as container:
            if not container.streams.video:
                raise BadMedia("corrupt", f"{name}: no video stream")
            return pass_fn(container, container.streams.video[0])

    def count_frames(container, stream) -> int:
        return stream.frames or sum(1 for packet in container.demux(stream) if packet.size)

    def keep(total: int):
        wanted = uniform_indices(total, count)
        wanted_set = set(wanted.tolist())

        def pass_fn(container, stream):
            stream.thread_type = "AUTO"
            kept: dict[int, np.ndarray] = {}
            n = 0
            try:
                for i, frame in enumerate(container.decode(stream)):
                    n = i + 1
                    if i in wanted_set and i not in kept:
                        kept[i] = frame.to_ndarray(format="rgb24")
            except (av.error.FFmpegError, ValueError, OSError) as e:
                if n == 0:
                    raise BadMedia("corrupt", f"{name}: cannot decode as video: {e}") from None
            return n, kept, wanted

        return pass_fn

    try:
        total = run(count_frames)
        n, kept, wanted = run(keep(max(total, 1)))
        if n == 0:
            raise BadMedia("corrupt", f"{name}: no video frame decoded")
        if n != total:
            n, kept, wanted = run(keep(n))
    except BadMedia:
        raise
    except (av.error.FFmpegError, ValueError, OSError) as e:
        raise BadMedia("corrupt", f"{name}: cannot decode as video: {e}") from None
    return np.stack([kept[int(i)] for i in wanted])


def read_video(source: MediaSource, num_frames: int, fps: float | None = None) -> np.ndarray:
    """The first `num_frames` frames sampled at `fps` (None: every frame), uint8 [num_frames, H, W, 3];
    BadMedia "missing", "corrupt" or "too_short"."""
    frames = decode_frames(source, num_frames, fps)
    if len(frames) < num_frames:
        at = f" at {fps:g} fps" if fps is not None else ""
        raise BadMedia("too_short", f"{describe(source)}: {len(frames)} frames{at}, {num_frames} needed")
    return frames


def open_image(source: MediaSource):
    """An image file (or its bytes) as a decoded PIL image in RGB; BadMedia "missing" or "corrupt"."""
    from PIL import Image, UnidentifiedImageError

    opened = _open_source(source)
    try:
        with Image.open(opened) as image:
            return image.convert("RGB")  # convert() decodes the whole image, so a truncated file fails here
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        raise BadMedia("corrupt", f"{describe(source)}: cannot decode as image: {e}") from None


def read_image(source: MediaSource) -> np.ndarray:
    """An image file (or its bytes) as uint8 [1, H, W, 3] RGB; BadMedia "missing" or "corrupt"."""
    return np.asarray(open_image(source), dtype=np.uint8)[None].copy()
