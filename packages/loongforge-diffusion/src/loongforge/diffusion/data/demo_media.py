"""`write_demo_videos`: a small captioned text-to-video set of coloured shapes moving on a dark
background, for demos and tests.

    root = write_demo_videos(Path("runs/demo_videos"))   # 24 videos, 9 frames of 32 x 32 at 8 fps

Video i shows one shape (a square or a circle) of one colour (red, green, blue, yellow) moving in
one direction (left, right, up, down) on a dark gray background, captioned
"a <colour> <shape> moving <direction>". The 2 x 4 x 4 = 32 combinations are put in an order drawn
from `seed` (`numpy.random.default_rng(seed).permutation`), and video i takes combination
i mod 32, so a set of 32 videos or more holds every combination.

The shape's size is s = max(4, min(H, W) // 4) pixels (a square's side, a circle's diameter), and
m = s / 2. Frame n of N (p = n / (N - 1)) has the shape's centre (column, row) at

    right:  (m + p * (W - 1 - 2m), (H - 1) / 2)        left:  (W - 1 - m - p * (W - 1 - 2m), (H - 1) / 2)
    down:   ((W - 1) / 2, m + p * (H - 1 - 2m))        up:    ((W - 1) / 2, H - 1 - m - p * (H - 1 - 2m))

A square covers the pixels (c, r) with |c - column| < s / 2 and |r - row| < s / 2; a circle those
with (c - column)^2 + (r - row)^2 <= (s / 2)^2.

The layout: `videos/00000.mp4` ... (H.264, libx264, yuv420p, `fps` frames per second) and
`captions.jsonl` with one line `{"video": "videos/00000.mp4", "caption": "..."}` per video, in
order, plus `demo.json` recording the parameters. The set is built in a temporary sibling directory
and renamed into place once complete; a `root` that already holds a demo set of the same
parameters is returned as it is, an empty directory is replaced, anything else is a UserError and
is left untouched.
"""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from loongforge.core.errors import UserError
from loongforge.core.outputs import write_once

DEMO_FORMAT = 1  # bump when the content changes
SHAPES = ("square", "circle")
COLOURS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (40, 70, 230), "yellow": (230, 210, 40)}
DIRECTIONS = ("left", "right", "up", "down")
BACKGROUND = (24, 24, 28)
ENCODER = "libx264"


def shape_size(height: int, width: int) -> int:
    return max(4, min(height, width) // 4)


def shape_centre(direction: str, n: int, frames: int, height: int, width: int) -> tuple[float, float]:
    """(column, row) of the shape's centre in frame `n` of `frames` (the module docstring's formula)."""
    m = shape_size(height, width) / 2
    p = n / (frames - 1)
    if direction == "right":
        return m + p * (width - 1 - 2 * m), (height - 1) / 2
    if direction == "left":
        return width - 1 - m - p * (width - 1 - 2 * m), (height - 1) / 2
    if direction == "down":
        return (width - 1) / 2, m + p * (height - 1 - 2 * m)
    if direction == "up":
        return (width - 1) / 2, height - 1 - m - p * (height - 1 - 2 * m)
    raise ValueError(f"unknown direction {direction!r}")


def demo_entries(count: int = 24, seed: int = 0) -> list[dict]:
    """Each video's `shape`, `colour`, `direction` and `caption`, in order."""
    combos = [(shape, colour, direction) for shape in SHAPES for colour in COLOURS for direction in DIRECTIONS]
    order = np.random.default_rng(seed).permutation(len(combos))
    out = []
    for i in range(count):
        shape, colour, direction = combos[int(order[i % len(combos)])]
        out.append({"shape": shape, "colour": colour, "direction": direction, "caption": f"a {colour} {shape} moving {direction}"})
    return out


def render_frame(entry: dict, n: int, frames: int, height: int, width: int) -> np.ndarray:
    """Frame `n` of a video (uint8, H x W x 3, RGB), before encoding."""
    image = np.empty((height, width, 3), np.uint8)
    image[:] = BACKGROUND
    column, row = shape_centre(entry["direction"], n, frames, height, width)
    half = shape_size(height, width) / 2
    rows, cols = np.mgrid[0:height, 0:width]
    if entry["shape"] == "square":
        inside = (np.abs(cols - column) < half) & (np.abs(rows - row) < half)
    else:
        inside = (cols - column) ** 2 + (rows - row) ** 2 <= half * half
    image[inside] = COLOURS[entry["colour"]]
    return image


def write_demo_videos(root: Path, count: int = 24, frames: int = 9, height: int = 32, width: int = 32, fps: int = 8, seed: int = 0) -> Path:
    """Write the demo set (see the module docstring) at `root` and return `root` as a Path; an
    existing complete one of the same parameters is returned untouched. A UserError when `root` is
    anything else (it is left as it is) or a parameter is out of range."""
    params = _check_params(count=count, frames=frames, height=height, width=width, fps=fps, seed=seed)
    return write_once(root, lambda tmp: _write(tmp, params), lambda r: _existing(r, params))


def _check_params(**params) -> dict:
    for name, value in params.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise UserError(f"demo videos: {name} must be an int, got {value!r}")
    p = {name: int(value) for name, value in params.items()}
    for name, low in (("count", 1), ("frames", 2), ("height", 16), ("width", 16), ("fps", 1), ("seed", 0)):
        if p[name] < low:
            raise UserError(f"demo videos: {name} must be at least {low}, got {p[name]}")
    for name in ("height", "width"):
        if p[name] % 2:
            raise UserError(f"demo videos: {name} must be even (H.264 in yuv420p), got {p[name]}")
    return {"format": DEMO_FORMAT, **p}


def _existing(root: Path, params: dict) -> Path:
    if not root.is_dir():
        raise UserError(f"{root} exists and is not a directory; choose another path for the demo videos")
    try:
        recorded = json.loads((root / "demo.json").read_text())
    except (OSError, ValueError):
        recorded = None
    if not isinstance(recorded, dict):
        raise UserError(f"{root} exists and is not a LoongForge demo video set; it was left as it is (choose another path)")
    if recorded != params:
        raise UserError(f"{root} holds demo videos written with {recorded}, not {params}; choose another path or remove it")
    missing = [p for p in ["captions.jsonl", *(_video_name(i) for i in range(params["count"]))] if not (root / p).is_file()]
    if missing:
        raise UserError(f"{root}: the demo video set is incomplete ({missing[0]} is missing); remove it to write it again")
    return root


def _video_name(i: int) -> str:
    return f"videos/{i:05d}.mp4"


def _write(root: Path, params: dict) -> None:
    if ENCODER not in av.codecs_available:
        raise UserError(f"this PyAV build has no {ENCODER} encoder (the demo videos are H.264)")
    frames, height, width, fps = params["frames"], params["height"], params["width"], params["fps"]
    (root / "videos").mkdir()
    lines = []
    for i, entry in enumerate(demo_entries(params["count"], params["seed"])):
        name = _video_name(i)
        with av.open(str(root / name), "w") as container:
            options = {"crf": "18", "preset": "veryfast", "g": str(fps), "threads": "1"}
            stream = container.add_stream(ENCODER, rate=fps, options=options)
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            for n in range(frames):
                frame = av.VideoFrame.from_ndarray(render_frame(entry, n, frames, height, width), format="rgb24")
                frame.pts, frame.time_base = n, Fraction(1, fps)
                container.mux(stream.encode(frame))
            container.mux(stream.encode())
        lines.append(json.dumps({"video": name, "caption": entry["caption"]}))
    (root / "captions.jsonl").write_text("\n".join(lines) + "\n")
    (root / "demo.json").write_text(json.dumps(params, indent=2))
