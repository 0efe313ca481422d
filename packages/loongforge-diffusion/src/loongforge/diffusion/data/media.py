"""Reading videos (PyAV) and images (PIL) as uint8 frames, and resizing them for the VAE, without
torchvision.

`read_video(path, num_frames, fps)` samples the first video stream at `fps` frames per second from
its first frame: sample k is the frame shown at time t0 + k / fps (t0: the first frame's
presentation time), i.e. the last frame whose presentation time is at or before it, for as long as
that time is before the end of the last frame (its time plus its duration). `fps=None` takes every
frame. The first `num_frames` samples are returned; a video with fewer is a `BadMedia` of reason
"too_short". A missing file is "missing"; a file that does not open or decode as a video (or
image) is "corrupt".

`resize_crop(frames, height, width)` scales the frames so that they cover height x width (the
shorter side fits, bilinear with antialiasing, on float values) and crops the centre, giving a
float32 tensor [3, frames, height, width] in [-1, 1] (pixel / 127.5 - 1): the VAE's input.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from loongforge.core.errors import UserError

REASONS = ("missing", "corrupt", "too_short")


class BadMedia(UserError):
    """A media file that cannot be used: `reason` is one of REASONS, the message names the file."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


def _check_file(path: Path) -> Path:
    path = Path(path)
    if not path.is_file():
        raise BadMedia("missing", f"{path}: file not found")
    return path


def decode_frames(path: Path, limit: int | None, fps: float | None) -> np.ndarray:
    """Up to `limit` frames (None: all) sampled as `read_video` does, uint8 [n, H, W, 3]; n may
    be smaller than `limit`. BadMedia "missing" or "corrupt" (a video with no frame is corrupt)."""
    import av

    path = _check_file(path)
    if fps is not None and not fps > 0:
        raise ValueError(f"fps must be positive or None, got {fps}")
    out: list[np.ndarray] = []
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise BadMedia("corrupt", f"{path}: no video stream")
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
            raise BadMedia("corrupt", f"{path}: cannot decode as video: {e}") from None
        # a damaged tail: keep the frames decoded before it (they are whole frames)
    if not out:
        raise BadMedia("corrupt", f"{path}: no video frame decoded")
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


def read_video(path: Path, num_frames: int, fps: float | None = None) -> np.ndarray:
    """The first `num_frames` frames sampled at `fps` (None: every frame), uint8 [num_frames, H, W, 3];
    BadMedia "missing", "corrupt" or "too_short"."""
    frames = decode_frames(path, num_frames, fps)
    if len(frames) < num_frames:
        at = f" at {fps:g} fps" if fps is not None else ""
        raise BadMedia("too_short", f"{path}: {len(frames)} frames{at}, {num_frames} needed")
    return frames


def read_image(path: Path) -> np.ndarray:
    """An image file as uint8 [1, H, W, 3] RGB; BadMedia "missing" or "corrupt"."""
    from PIL import Image, UnidentifiedImageError

    path = _check_file(path)
    try:
        with Image.open(path) as image:
            rgb = np.asarray(image.convert("RGB"), dtype=np.uint8)
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        raise BadMedia("corrupt", f"{path}: cannot decode as image: {e}") from None
    return rgb[None].copy()


def resize_crop(frames, height: int, width: int) -> torch.Tensor:
    """uint8 frames [F, H, W, 3] (numpy or torch) scaled to cover height x width (bilinear,
    antialiased, on floats) and centre-cropped: float32 [3, F, height, width] in [-1, 1]."""
    x = torch.as_tensor(np.asarray(frames) if not isinstance(frames, torch.Tensor) else frames)
    if x.ndim != 4 or x.shape[-1] != 3:
        raise ValueError(f"frames must be [F, H, W, 3], got {tuple(x.shape)}")
    f, h, w, _ = x.shape
    x = x.permute(0, 3, 1, 2).to(torch.float32)  # [F, 3, H, W]
    scale = max(height / h, width / w)
    new_h, new_w = max(height, round(h * scale)), max(width, round(w * scale))
    if (new_h, new_w) != (h, w):
        x = torch.nn.functional.interpolate(x, size=(new_h, new_w), mode="bilinear", align_corners=False, antialias=True)
    top, left = (new_h - height) // 2, (new_w - width) // 2
    x = x[:, :, top : top + height, left : left + width]
    x = (x / 127.5 - 1.0).clamp_(-1.0, 1.0)
    return x.permute(1, 0, 2, 3).contiguous()
