"""What a LeRobot dataset's `meta/` folder says, in one shape for every supported version.

`load_meta(root)` reads `meta/info.json`, picks the layout from its `codebase_version` (v2.1:
one parquet and one mp4 per episode, `meta/*.jsonl`; v3.0: several episodes per parquet and
mp4 file, `meta/episodes/*/*.parquet`, `meta/tasks.parquet`) and returns a `LeRobotMeta`: the
fps, the features, each episode's global frame range and where its rows and video frames lie,
the tasks and the statistics.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from loongforge.core.errors import UserError

INFO_PATH = "meta/info.json"
SUPPORTED_VERSIONS = ("v2.1", "v3.0")


@dataclass(frozen=True)
class VideoSpan:
    """Where one episode's frames of one camera lie: the file, and the time (s) in it of the
    episode's first frame (0 for v2.1, where each episode has its own file)."""

    path: Path
    from_timestamp: float = 0.0
    to_timestamp: float | None = None


@dataclass(frozen=True)
class Episode:
    """One episode: global frames [start, stop), its tasks, its parquet rows (from `data_row`
    in `data_path`) and its video span per camera."""

    index: int
    start: int
    stop: int
    tasks: tuple[str, ...] = ()
    data_path: Path | None = None
    data_row: int = 0
    videos: Mapping[str, VideoSpan] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return self.stop - self.start


@dataclass
class LeRobotMeta:
    root: Path
    version: str
    info: dict
    features: dict[str, dict]
    episodes: list[Episode]
    tasks: dict[int, str]
    stats: dict[str, dict[str, Any]]
    episode_stats: Callable[[int], dict[str, dict[str, Any]]]

    @property
    def fps(self) -> int | float:
        return self.info["fps"]

    @property
    def video_keys(self) -> list[str]:
        return [k for k, ft in self.features.items() if ft.get("dtype") == "video"]

    @property
    def num_frames(self) -> int:
        return self.episodes[-1].stop if self.episodes else 0


def require_file(path: Path, what: str) -> Path:
    if not path.is_file():
        raise UserError(f"{path} not found ({what})")
    return path


def read_json(path: Path, what: str) -> Any:
    require_file(path, what)
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({what}): {e}") from None


def read_jsonl(path: Path, what: str) -> list[dict]:
    require_file(path, what)
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{n} is not valid JSON ({what}): {e}") from None
    return rows


def format_path(root: Path, info: dict, template_key: str, **fields) -> Path:
    """`root / info[template_key].format(**fields)`; a UserError naming the template when it asks
    for a field this layout does not have."""
    template = info.get(template_key)
    if not isinstance(template, str):
        raise UserError(f"{root / INFO_PATH}: `{template_key}` is missing (a path template is needed to find the files)")
    try:
        return root / template.format(**fields)
    except (KeyError, IndexError, ValueError) as e:
        raise UserError(
            f"{root / INFO_PATH}: `{template_key}` {template!r} does not fit this layout (fields: {sorted(fields)}): {e}"
        ) from None


def read_version(root: Path) -> tuple[str, dict]:
    """(codebase_version, info.json) of the dataset at `root`; a UserError for a missing file or
    an unsupported version."""
    path = root / INFO_PATH
    info = read_json(path, "a LeRobot dataset root has meta/info.json")
    if not isinstance(info, dict):
        raise UserError(f"{path}: expected a JSON object, got {type(info).__name__}")
    version = info.get("codebase_version")
    if version is None:
        raise UserError(f"{path} has no codebase_version (supported: {', '.join(SUPPORTED_VERSIONS)})")
    normalized = f"v{version}" if isinstance(version, str) and not version.startswith("v") else version
    if normalized not in SUPPORTED_VERSIONS:
        raise UserError(f"{path}: unsupported LeRobot codebase_version {version!r} (supported: {', '.join(SUPPORTED_VERSIONS)})")
    for key in ("fps", "features"):
        if key not in info:
            raise UserError(f"{path} has no `{key}`")
    if not isinstance(info["fps"], (int, float)) or info["fps"] <= 0:
        raise UserError(f"{path}: fps must be a positive number, got {info['fps']!r}")
    return normalized, info


def check_ranges(root: Path, info: dict, episodes: list[Episode]) -> None:
    """Episodes must tile [0, total_frames) in order, as LeRobot's global frame index assumes."""
    expected = 0
    for ep in episodes:
        if ep.start != expected or ep.stop < ep.start:
            raise UserError(f"{root}: episode {ep.index} covers frames [{ep.start}, {ep.stop}), expected it to start at {expected}")
        expected = ep.stop
    total = info.get("total_frames")
    if total is not None and total != expected:
        raise UserError(f"{root / INFO_PATH}: total_frames is {total} but the episodes hold {expected} frames")


def load_meta(root: str | Path) -> LeRobotMeta:
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"{root} is not a directory (expected a LeRobot dataset root)")
    version, info = read_version(root)
    if version == "v2.1":
        from loongforge.embodied.data.lerobot_v21 import load_v21

        return load_v21(root, info)
    from loongforge.embodied.data.lerobot_v30 import load_v30

    return load_v30(root, info)
