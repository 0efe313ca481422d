"""`write_demo_dataset`: a small, learnable LeRobot v3.0 dataset of a 2-D point robot.

    root = write_demo_dataset(Path("runs/demo_data"))        # about a second; quiet
    ds = LeRobotDataset(root)                                 # 8 episodes x 40 frames at 10 fps

The world is the square [-1, 1]^2 with y up. Each episode draws a red square, a blue square and a
start point; the task ("move to the red square" for even episodes, "move to the blue square" for
odd ones) names the target. Every frame holds

    observation.state   float32 [x, y, target_x, target_y]
    action              float32 [vx, vy]: GAIN * (target - point), its norm clipped to MAX_SPEED
                        (units/s), plus N(0, ACTION_NOISE) per axis; the point then moves by
                        action / fps (clipped to the world), so state[t + 1] follows from state[t]
                        and action[t]
    observation.images.top    the world from above: both squares (red, blue; TARGET_SIDE pixels)
                              and the point (green, POINT_SIDE pixels) on a dark gray background
    observation.images.wrist  the view centred on the point: the point at the centre and the two
                              squares at their offsets from it, at half the top camera's scale (an
                              offset of [-2, 2]^2 fills the image, so both are always in view)
    timestamp, frame_index, episode_index, index, task_index

so a policy can learn the action from the state, or from the images and the task. A square's pixel
centre (column, row) for world coordinates (x, y) is, with S = image_size and m = TARGET_SIDE / 2,

    top:    column = m + (x + 1) / 2 * (S - 1 - 2m),   row = m + (1 - y) / 2 * (S - 1 - 2m)
    wrist:  column = m + (dx + 2) / 4 * (S - 1 - 2m),  row = m + (2 - dy) / 4 * (S - 1 - 2m)

with (dx, dy) the offset from the point; a square of side s covers the s pixels from
round(centre - (s - 1) / 2) in each direction. Everything follows from `seed` (episode e from
`numpy.random.default_rng([seed, e])`); the videos are H.264 (libx264, yuv420p).

The layout is LeRobot's v3.0: `meta/info.json` (its `loongforge_demo` key records the parameters),
`meta/tasks.parquet`, `meta/episodes/chunk-000/file-000.parquet` (with each episode's
`stats/<feature>/<stat>` columns and video spans), `meta/stats.json` (mean, std, min, max, count
and, for every feature but the cameras, q01, q10, q50, q90, q99; camera stats are per channel, of
shape (3, 1, 1), on values in [0, 1], from the frames as drawn), `data/chunk-000/file-000.parquet`
holding every episode, and `videos/<camera>/chunk-000/file-000.mp4` with every episode one after
the other (episode e from `videos/<camera>/from_timestamp` = its first global frame / fps).

The dataset is built in a temporary sibling directory and renamed into place once complete and on
disk. A `root` that already holds a complete demo dataset of the same parameters is returned as it
is; an empty directory is replaced; anything else is a UserError, and nothing of it is touched.
"""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from loongforge.core.errors import UserError
from loongforge.core.outputs import write_once
from loongforge.embodied.data.normalize import QUANTILES

DEMO_KEY = "loongforge_demo"
DEMO_FORMAT = 1  # bump when the content changes: a dataset of another format is "other parameters"
TASKS = ("move to the red square", "move to the blue square")
CAMERAS = ("observation.images.top", "observation.images.wrist")
STATE_NAMES = ("x", "y", "target_x", "target_y")
ACTION_NAMES = ("vx", "vy")
GAIN = 2.0  # 1/s: the velocity is GAIN times the offset to the target ...
MAX_SPEED = 1.0  # ... its norm clipped to this (world units per second)
ACTION_NOISE = 0.02
MIN_SQUARE_DISTANCE = 1.0  # between the red and the blue square (apart in the wrist view too)
MIN_START_DISTANCE = 0.8  # between the start point and the target

RED = (220, 40, 40)
BLUE = (40, 60, 220)
GREEN = (40, 220, 40)
TOP_BACKGROUND = (50, 50, 50)
WRIST_BACKGROUND = (90, 75, 60)

CHUNKS_SIZE = 1000
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
EPISODES_PATH = "meta/episodes/chunk-000/file-000.parquet"
ENCODER = "libx264"


def point_side(image_size: int) -> int:
    return max(3, image_size // 10)


def target_side(image_size: int) -> int:
    return max(5, image_size // 6)


def write_demo_dataset(root: Path, episodes: int = 8, frames: int = 40, fps: int = 10, image_size: int = 32, seed: int = 0) -> Path:
    """Write the demo dataset (see the module docstring) at `root` and return `root` as a Path;
    return an existing complete one of the same parameters untouched. A UserError, naming the
    path, when `root` is anything else (it is left as it is) or a parameter is out of range."""
    params = _check_params(episodes=episodes, frames=frames, fps=fps, image_size=image_size, seed=seed)
    return write_once(root, lambda tmp: _write(tmp, params), lambda r: _existing(r, params))


def _check_params(**params: int) -> dict:
    for name, value in params.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise UserError(f"demo dataset: {name} must be an int, got {value!r}")
    p = {name: int(value) for name, value in params.items()}
    for name, low in (("episodes", 1), ("frames", 2), ("fps", 1), ("image_size", 16), ("seed", 0)):
        if p[name] < low:
            raise UserError(f"demo dataset: {name} must be at least {low}, got {p[name]}")
    if p["image_size"] % 2:
        raise UserError(f"demo dataset: image_size must be even (H.264 in yuv420p), got {p['image_size']}")
    return {"format": DEMO_FORMAT, **p}


def _existing(root: Path, params: dict) -> Path:
    """`root` when it holds a complete demo dataset written with `params`; else a UserError."""
    if not root.is_dir():
        raise UserError(f"{root} exists and is not a directory; choose another path for the demo dataset")
    try:
        info = json.loads((root / "meta/info.json").read_text())
    except (OSError, ValueError):
        info = None
    recorded = info.get(DEMO_KEY) if isinstance(info, dict) else None
    if recorded is None:
        raise UserError(f"{root} exists and is not a LoongForge demo dataset; it was left as it is (choose another path)")
    if recorded != params:
        raise UserError(f"{root} holds a demo dataset written with {recorded}, not {params}; choose another path or remove it")
    missing = [p for p in _files() if not (root / p).is_file()]
    if missing:
        raise UserError(f"{root}: the demo dataset is incomplete ({missing[0]} is missing); remove it to write it again")
    return root


def _files() -> list[str]:
    paths = ["meta/info.json", "meta/tasks.parquet", "meta/stats.json", EPISODES_PATH, DATA_PATH.format(chunk_index=0, file_index=0)]
    return paths + [VIDEO_PATH.format(video_key=key, chunk_index=0, file_index=0) for key in CAMERAS]


# ---- content ------------------------------------------------------------------------------------


def _episode(seed: int, e: int, frames: int, fps: int) -> dict[str, np.ndarray]:
    """One episode's squares, states (float32, (frames, 4)) and actions (float32, (frames, 2))."""
    rng = np.random.default_rng([seed, e])
    while True:
        red, blue = rng.uniform(-0.8, 0.8, size=(2, 2))
        if np.linalg.norm(red - blue) >= MIN_SQUARE_DISTANCE:
            break
    target = red if e % 2 == 0 else blue
    while True:
        point = rng.uniform(-0.9, 0.9, size=2)
        if np.linalg.norm(point - target) >= MIN_START_DISTANCE:
            break
    states = np.empty((frames, 4), np.float32)
    actions = np.empty((frames, 2), np.float32)
    for t in range(frames):
        states[t] = [*point, *target]
        velocity = GAIN * (target - point)
        speed = np.linalg.norm(velocity)
        if speed > MAX_SPEED:
            velocity *= MAX_SPEED / speed
        actions[t] = velocity + rng.normal(0.0, ACTION_NOISE, size=2)
        point = np.clip(point + actions[t].astype(np.float64) / fps, -1.0, 1.0)
    return {"red": red, "blue": blue, "state": states, "action": actions}


def _pixel(value: float, low: float, high: float, size: int) -> float:
    margin = target_side(size) / 2
    return margin + (value - low) / (high - low) * (size - 1 - 2 * margin)


def _square(image: np.ndarray, column: float, row: float, side: int, colour: tuple[int, int, int]) -> None:
    c0, r0 = int(np.round(column - (side - 1) / 2)), int(np.round(row - (side - 1) / 2))
    image[max(r0, 0) : max(r0 + side, 0), max(c0, 0) : max(c0 + side, 0)] = colour


def _render(size: int, camera: str, state: np.ndarray, red: np.ndarray, blue: np.ndarray) -> np.ndarray:
    point = state[:2].astype(np.float64)
    image = np.empty((size, size, 3), np.uint8)
    if camera == CAMERAS[0]:
        image[:] = TOP_BACKGROUND
        place = [(red, RED, target_side(size)), (blue, BLUE, target_side(size)), (point, GREEN, point_side(size))]
        span = 1.0
    else:
        image[:] = WRIST_BACKGROUND
        place = [(red - point, RED, target_side(size)), (blue - point, BLUE, target_side(size)), (np.zeros(2), GREEN, point_side(size))]
        span = 2.0
    for (x, y), colour, side in place:
        _square(image, _pixel(x, -span, span, size), _pixel(-y, -span, span, size), side, colour)
    return image


# ---- files --------------------------------------------------------------------------------------


def _stats(values: np.ndarray) -> dict[str, np.ndarray]:
    """Stats over the first axis, in float64 (std with ddof 0, exact linear quantiles, as
    `compute_stats`); a scalar feature's have shape (1,)."""
    v = np.asarray(values, dtype=np.float64)
    v = v.reshape(len(v), -1) if v.ndim == 1 else v
    out = {"min": v.min(0), "max": v.max(0), "mean": v.mean(0), "std": v.std(0), "count": np.array([len(v)], np.int64)}
    for q, value in zip(QUANTILES, np.quantile(v, QUANTILES, axis=0)):
        out[f"q{round(q * 100):02d}"] = value
    return out


class _ImageStats:
    """Per-channel stats of uint8 frames on [0, 1], shape (3, 1, 1), from exact integer sums."""

    def __init__(self):
        self.sum = np.zeros(3, np.int64)
        self.sumsq = np.zeros(3, np.int64)
        self.min = np.full(3, 255, np.int64)
        self.max = np.zeros(3, np.int64)
        self.pixels = 0
        self.frames = 0

    def add(self, images: np.ndarray) -> None:
        flat = images.reshape(-1, 3).astype(np.int64)
        self.sum += flat.sum(0)
        self.sumsq += (flat * flat).sum(0)
        self.min = np.minimum(self.min, flat.min(0))
        self.max = np.maximum(self.max, flat.max(0))
        self.pixels += len(flat)
        self.frames += len(images)

    def result(self) -> dict[str, np.ndarray]:
        mean = self.sum / self.pixels
        variance = np.maximum(self.sumsq / self.pixels - mean * mean, 0.0)
        out = {"min": self.min / 255, "max": self.max / 255, "mean": mean / 255, "std": np.sqrt(variance) / 255}
        return {k: v.reshape(3, 1, 1) for k, v in out.items()} | {"count": np.array([self.frames], np.int64)}

    @classmethod
    def merged(cls, parts: list[_ImageStats]) -> _ImageStats:
        out = cls()
        for part in parts:
            out.sum += part.sum
            out.sumsq += part.sumsq
            out.min = np.minimum(out.min, part.min)
            out.max = np.maximum(out.max, part.max)
            out.pixels += part.pixels
            out.frames += part.frames
        return out


def _features(params: dict) -> dict[str, dict]:
    fps, size = params["fps"], params["image_size"]
    scalar = {"shape": [1], "names": None, "fps": fps}
    video = {
        "dtype": "video",
        "shape": [size, size, 3],
        "names": ["height", "width", "channels"],
        "info": {
            "video.height": size,
            "video.width": size,
            "video.codec": "h264",
            "video.pix_fmt": "yuv420p",
            "video.is_depth_map": False,
            "video.fps": fps,
            "video.channels": 3,
            "has_audio": False,
        },
    }
    return {
        "observation.state": {"dtype": "float32", "shape": [4], "names": list(STATE_NAMES), "fps": fps},
        "action": {"dtype": "float32", "shape": [2], "names": list(ACTION_NAMES), "fps": fps},
        **{key: dict(video) for key in CAMERAS},
        "timestamp": {"dtype": "float32", **scalar},
        "frame_index": {"dtype": "int64", **scalar},
        "episode_index": {"dtype": "int64", **scalar},
        "index": {"dtype": "int64", **scalar},
        "task_index": {"dtype": "int64", **scalar},
    }


DATA_SCHEMA = pa.schema(
    [
        ("observation.state", pa.list_(pa.float32(), 4)),
        ("action", pa.list_(pa.float32(), 2)),
        ("timestamp", pa.float32()),
        ("frame_index", pa.int64()),
        ("episode_index", pa.int64()),
        ("index", pa.int64()),
        ("task_index", pa.int64()),
    ]
)
NON_VIDEO = DATA_SCHEMA.names


def _open_video(path: Path, params: dict):
    if ENCODER not in av.codecs_available:
        raise UserError(f"this PyAV build has no {ENCODER} encoder (the demo dataset's videos are H.264)")
    path.parent.mkdir(parents=True, exist_ok=True)
    container = av.open(str(path), "w")
    options = {"crf": "18", "preset": "veryfast", "g": str(params["fps"]), "threads": "1"}
    stream = container.add_stream(ENCODER, rate=params["fps"], options=options)
    stream.width = stream.height = params["image_size"]
    stream.pix_fmt = "yuv420p"
    return container, stream


def _encode(container, stream, images: np.ndarray, first_pts: int, fps: int) -> None:
    for n, image in enumerate(images):
        frame = av.VideoFrame.from_ndarray(image, format="rgb24")
        frame.pts, frame.time_base = first_pts + n, Fraction(1, fps)
        container.mux(stream.encode(frame))


def _write_videos(root: Path, params: dict, trajectories: list[dict]) -> dict[str, list[_ImageStats]]:
    """Every episode of every camera, one file per camera; returns each camera's stats per episode."""
    frames, fps, size = params["frames"], params["fps"], params["image_size"]
    stats: dict[str, list[_ImageStats]] = {}
    for key in CAMERAS:
        container, stream = _open_video(root / VIDEO_PATH.format(video_key=key, chunk_index=0, file_index=0), params)
        with container:
            stats[key] = []
            for e, traj in enumerate(trajectories):
                images = np.stack([_render(size, key, s, traj["red"], traj["blue"]) for s in traj["state"]])
                _encode(container, stream, images, e * frames, fps)
                stats[key].append(_ImageStats())
                stats[key][-1].add(images)
            container.mux(stream.encode())
    return stats


def _write(root: Path, params: dict) -> None:
    n_episodes, frames, fps = params["episodes"], params["frames"], params["fps"]
    trajectories = [_episode(params["seed"], e, frames, fps) for e in range(n_episodes)]
    total = n_episodes * frames
    columns = {
        "observation.state": np.concatenate([t["state"] for t in trajectories]),
        "action": np.concatenate([t["action"] for t in trajectories]),
        "timestamp": np.tile(np.arange(frames, dtype=np.float64) / fps, n_episodes).astype(np.float32),
        "frame_index": np.tile(np.arange(frames, dtype=np.int64), n_episodes),
        "episode_index": np.repeat(np.arange(n_episodes, dtype=np.int64), frames),
        "index": np.arange(total, dtype=np.int64),
        "task_index": np.repeat(np.arange(n_episodes, dtype=np.int64) % len(TASKS), frames),
    }
    data_path = root / DATA_PATH.format(chunk_index=0, file_index=0)
    data_path.parent.mkdir(parents=True)
    arrays = [
        pa.FixedSizeListArray.from_arrays(pa.array(v.reshape(-1)), v.shape[1]) if v.ndim == 2 else pa.array(v)
        for v in (columns[name] for name in DATA_SCHEMA.names)
    ]
    pq.write_table(pa.Table.from_arrays(arrays, schema=DATA_SCHEMA), data_path)

    camera_stats = _write_videos(root, params, trajectories)

    rows = []
    for e in range(n_episodes):
        start, stop = e * frames, (e + 1) * frames
        row = {
            "episode_index": e,
            "tasks": [TASKS[e % len(TASKS)]],
            "length": frames,
            "data/chunk_index": 0,
            "data/file_index": 0,
            "dataset_from_index": start,
            "dataset_to_index": stop,
        }
        for key in CAMERAS:
            row |= {
                f"videos/{key}/chunk_index": 0,
                f"videos/{key}/file_index": 0,
                f"videos/{key}/from_timestamp": start / fps,
                f"videos/{key}/to_timestamp": stop / fps,
            }
        row |= {"meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0}
        episode_stats = {name: _stats(columns[name][start:stop]) for name in NON_VIDEO}
        episode_stats |= {key: camera_stats[key][e].result() for key in CAMERAS}
        for feature, d in episode_stats.items():
            row |= {f"stats/{feature}/{name}": value.tolist() for name, value in d.items()}
        rows.append(row)
    (root / EPISODES_PATH).parent.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), root / EPISODES_PATH)

    stats = {name: _stats(columns[name]) for name in NON_VIDEO}
    stats |= {key: _ImageStats.merged(camera_stats[key]).result() for key in CAMERAS}
    (root / "meta/stats.json").write_text(json.dumps({f: {k: v.tolist() for k, v in d.items()} for f, d in stats.items()}, indent=2))

    pandas_meta = {
        "index_columns": ["task"],
        "column_indexes": [
            {"name": None, "field_name": None, "pandas_type": "unicode", "numpy_type": "object", "metadata": {"encoding": "UTF-8"}}
        ],
        "columns": [
            {"name": "task_index", "field_name": "task_index", "pandas_type": "int64", "numpy_type": "int64", "metadata": None},
            {"name": "task", "field_name": "task", "pandas_type": "unicode", "numpy_type": "object", "metadata": None},
        ],
        "attributes": {},
        "creator": {"library": "pyarrow", "version": pa.__version__},
    }
    tasks = pa.table(
        {"task_index": pa.array(range(len(TASKS)), pa.int64()), "task": pa.array(TASKS, pa.string())},
    ).replace_schema_metadata({"pandas": json.dumps(pandas_meta)})
    pq.write_table(tasks, root / "meta/tasks.parquet")  # read by pandas as LeRobot writes it: the task as the index

    info = {
        "codebase_version": "v3.0",
        "robot_type": "point2d",
        "total_episodes": n_episodes,
        "total_frames": total,
        "total_tasks": len(TASKS),
        "chunks_size": CHUNKS_SIZE,
        "data_files_size_in_mb": 100,
        "video_files_size_in_mb": 200,
        "fps": fps,
        "splits": {"train": f"0:{n_episodes}"},
        "data_path": DATA_PATH,
        "video_path": VIDEO_PATH,
        "features": _features(params),
        DEMO_KEY: params,
    }
    (root / "meta/info.json").write_text(json.dumps(info, indent=4))
