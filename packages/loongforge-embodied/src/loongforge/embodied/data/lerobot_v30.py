"""The v3.0 layout: several episodes per parquet file and per mp4 file.

    meta/info.json                         codebase_version "v3.0", fps, features, chunks_size,
                                           data_path  "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet",
                                           video_path "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
    meta/episodes/chunk-*/file-*.parquet   one row per episode: episode_index, tasks, length,
                                           data/chunk_index, data/file_index,
                                           dataset_from_index, dataset_to_index (global frames [from, to)),
                                           videos/<key>/chunk_index, videos/<key>/file_index,
                                           videos/<key>/from_timestamp, videos/<key>/to_timestamp (s in that file),
                                           stats/<feature>/<stat>, meta/episodes/chunk_index, ...
    meta/tasks.parquet                     task_index, with the task string as the (pandas) index column `task`
    meta/stats.json                        {feature: {stat: value}}

A data file holds the rows of consecutive episodes, so an episode's first row in its file is its
dataset_from_index less that of the file's first episode.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path

import pyarrow.parquet as pq
from loongforge.core.errors import UserError
from loongforge.embodied.data.lerobot_meta import (
    Episode,
    LeRobotMeta,
    VideoSpan,
    check_ranges,
    format_path,
    read_json,
    require_file,
)
from loongforge.embodied.data.lerobot_stats import stats_from_columns, stats_to_numpy

EPISODES_DIR = "meta/episodes"
TASKS_PATH = "meta/tasks.parquet"
STATS_PATH = "meta/stats.json"


def _read_parquet(path: Path, columns: list[str] | None = None):
    try:
        return pq.read_table(path, columns=columns)
    except (OSError, ValueError) as e:  # pyarrow.ArrowInvalid is a ValueError
        raise UserError(f"{path}: cannot read as parquet: {e}") from None


def _column_names(path: Path) -> list[str]:
    try:
        return pq.read_schema(path).names
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: cannot read as parquet: {e}") from None


def _load_tasks(root: Path) -> dict[int, str]:
    path = require_file(root / TASKS_PATH, "the task strings")
    table = _read_parquet(path)
    names = table.column_names
    text = "task" if "task" in names else "__index_level_0__" if "__index_level_0__" in names else None
    if "task_index" not in names or text is None:
        raise UserError(f"{path}: expected columns `task_index` and `task`, has {names}")
    return {int(i): str(t) for i, t in zip(table.column("task_index").to_pylist(), table.column(text).to_pylist())}


def load_v30(root: Path, info: dict) -> LeRobotMeta:
    files = sorted((root / EPISODES_DIR).glob("*/*.parquet"))
    if not files:
        raise UserError(f"{root / EPISODES_DIR}: no chunk-*/file-*.parquet (the episode table) found")
    video_keys = [k for k, ft in info["features"].items() if ft.get("dtype") == "video"]
    required = ["episode_index", "dataset_from_index", "dataset_to_index", "data/chunk_index", "data/file_index"]
    for key in video_keys:
        required += [f"videos/{key}/{name}" for name in ("chunk_index", "file_index", "from_timestamp")]

    rows: list[dict] = []
    for path in files:
        names = _column_names(path)
        missing = [c for c in required if c not in names]
        if missing:
            raise UserError(f"{path}: the episode table lacks column(s) {missing}")
        table = _read_parquet(path, [c for c in names if not c.startswith("stats/")])
        rows += table.to_pylist()
    rows.sort(key=lambda row: row["episode_index"])

    episodes = []
    for row in rows:
        videos = {}
        for key in video_keys:
            path = format_path(
                root,
                info,
                "video_path",
                video_key=key,
                chunk_index=row[f"videos/{key}/chunk_index"],
                file_index=row[f"videos/{key}/file_index"],
            )
            to_ts = row.get(f"videos/{key}/to_timestamp")
            videos[key] = VideoSpan(path, float(row[f"videos/{key}/from_timestamp"]), None if to_ts is None else float(to_ts))
        data_path = format_path(root, info, "data_path", chunk_index=row["data/chunk_index"], file_index=row["data/file_index"])
        start, stop = int(row["dataset_from_index"]), int(row["dataset_to_index"])
        episodes.append(Episode(int(row["episode_index"]), start, stop, tuple(row.get("tasks") or ()), data_path, 0, videos))
    check_ranges(root, info, episodes)

    file_start: dict[Path, int] = {}
    for ep in episodes:
        file_start[ep.data_path] = min(ep.start, file_start.get(ep.data_path, ep.start))
    episodes = [replace(ep, data_row=ep.start - file_start[ep.data_path]) for ep in episodes]

    stats = stats_to_numpy(read_json(root / STATS_PATH, "dataset stats")) if (root / STATS_PATH).is_file() else {}
    episode_stats = partial(_episode_stats, files, [ep.index for ep in episodes], {})
    return LeRobotMeta(root, "v3.0", info, dict(info["features"]), episodes, _load_tasks(root), stats, episode_stats)


def _episode_stats(files: list[Path], indices: list[int], per_episode: dict[int, dict], i: int) -> dict:
    """Episode i's `stats/<feature>/<stat>` columns, nested; all episodes' are read on first use."""
    if not per_episode:
        for path in files:
            names = [c for c in _column_names(path) if c.startswith("stats/") or c == "episode_index"]
            for row in _read_parquet(path, names).to_pylist():
                per_episode[int(row["episode_index"])] = stats_from_columns(row)
    if indices[i] not in per_episode:
        raise UserError(f"{files[0].parent.parent}: no stats for episode {indices[i]}")
    return per_episode[indices[i]]
