"""Resolution and length buckets: every sample is resized, cropped and cut to one bucket's
height x width x frames, so that samples of one bucket batch together.

A Wan bucket has frames = 4k + 1 (the VAE keeps the first frame and compresses the rest 4x in
time: k + 1 latent frames; frames = 1 is an image) and height, width divisible by 16 (8x spatial
compression, then the transformer's 2 x 2 patches). `parse_buckets(["480x832x81", ...])` reads
"HxWxF" strings and checks that.

`choose_bucket(h, w, n_frames, buckets)`: among the buckets of at most `n_frames` frames, the one
whose aspect ratio is closest to h / w (distance |log(h / w) - log(H / W)|); of equally close
ones, the one with the most frames, then the largest area, then the first listed. None when no
bucket is short enough: the sample is "too_short".
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from loongforge.core.errors import UserError

_BUCKET = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*[xX]\s*(\d+)\s*$")


@dataclass(frozen=True, order=True)
class Bucket:
    height: int
    width: int
    frames: int

    def __str__(self) -> str:
        return f"{self.height}x{self.width}x{self.frames}"

    @property
    def latent_frames(self) -> int:
        return (self.frames - 1) // 4 + 1


def check_bucket(bucket: Bucket, name: str | None = None) -> Bucket:
    """`bucket` if it is a valid Wan bucket, else a UserError naming it (as `name` if given)."""
    label = name if name is not None else str(bucket)
    h, w, f = bucket.height, bucket.width, bucket.frames
    if h <= 0 or w <= 0 or f <= 0:
        raise UserError(f"bucket {label!r}: height, width and frames must be positive")
    if h % 16 or w % 16:
        raise UserError(f"bucket {label!r}: height and width must be divisible by 16 (got {h}x{w})")
    if (f - 1) % 4:
        raise UserError(f"bucket {label!r}: frames must be 4k+1 (1, 5, 9, ..., 81), got {f}")
    return bucket


def parse_buckets(specs) -> list[Bucket]:
    """Buckets from "HxWxF" strings (or Bucket objects, or [H, W, F] triples), validated; a
    UserError naming the first bad entry. Duplicates are an error too."""
    if isinstance(specs, str):
        specs = [s for s in specs.split(",") if s.strip()]
    out: list[Bucket] = []
    for spec in specs:
        if isinstance(spec, Bucket):
            bucket = spec
        elif isinstance(spec, str):
            m = _BUCKET.match(spec)
            if m is None:
                raise UserError(f"bucket {spec!r}: expected HEIGHTxWIDTHxFRAMES, e.g. 480x832x81")
            bucket = Bucket(*(int(g) for g in m.groups()))
        elif isinstance(spec, (list, tuple)) and len(spec) == 3 and all(isinstance(v, int) and not isinstance(v, bool) for v in spec):
            bucket = Bucket(*spec)
        else:
            raise UserError(f"bucket {spec!r}: expected HEIGHTxWIDTHxFRAMES, e.g. 480x832x81")
        check_bucket(bucket, spec if isinstance(spec, str) else None)
        if bucket in out:
            raise UserError(f"bucket {spec!r} is listed twice")
        out.append(bucket)
    if not out:
        raise UserError("no buckets given (need at least one HEIGHTxWIDTHxFRAMES)")
    return out


def choose_bucket(h: int, w: int, n_frames: int, buckets) -> Bucket | None:
    """The bucket for an h x w sample of `n_frames` frames (see the module docstring), or None."""
    target = math.log(h / w)
    best, best_key = None, None
    for bucket in buckets:
        if bucket.frames > n_frames:
            continue
        distance = round(abs(target - math.log(bucket.height / bucket.width)), 9)
        key = (distance, -bucket.frames, -bucket.height * bucket.width)
        if best_key is None or key < best_key:
            best, best_key = bucket, key
    return best
