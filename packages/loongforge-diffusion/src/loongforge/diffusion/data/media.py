"""Reading videos (PyAV) and images (PIL) as uint8 frames, and resizing them for the VAE, without
torchvision.

`read_video`, `decode_frames`, `read_image` and `BadMedia` are core's (`loongforge.core.data.media`,
shared with the VLM data): `read_video(path, num_frames, fps)` samples the first video stream at
`fps` frames per second from its first frame (sample k is the frame shown at time t0 + k / fps);
`fps=None` takes every frame. A video with fewer than `num_frames` samples is a `BadMedia` of reason
"too_short"; a missing file is "missing"; a file that does not open or decode as a video (or
image) is "corrupt".

`resize_crop(frames, height, width)` scales the frames so that they cover height x width (the
shorter side fits, bilinear with antialiasing, on float values) and crops the centre, giving a
float32 tensor [3, frames, height, width] in [-1, 1] (pixel / 127.5 - 1): the VAE's input.
"""

from __future__ import annotations

import numpy as np
import torch
from loongforge.core.data.media import REASONS, BadMedia, decode_frames, read_image, read_video

__all__ = ["REASONS", "BadMedia", "decode_frames", "read_image", "read_video", "resize_crop"]


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
