"""The v2.1 layout: one parquet file and one mp4 per camera for each episode.

    meta/info.json            codebase_version "v2.1", fps, features, chunks_size, total_*,
                              data_path  "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet",
                              video_path "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4"
    meta/episodes.jsonl       {"episode_index", "tasks": [str], "length"} per line
    meta/tasks.jsonl          {"task_index", "task"} per line
    meta/episodes_stats.jsonl {"episode_index", "stats": {feature: {min, max, mean, std, count}}} per line

An episode's chunk is episode_index // chunks_size; global frame indices run over the episodes
in episode_index order, each episode's frames after the previous one's.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from loongforge.core.errors import UserError
from loongforge.embodied.data.lerobot_meta import (
    Episode,
    LeRobotMeta,
    VideoSpan,
    check_ranges,
    format_path,
    read_json,
    read_jsonl,
)
from loongforge.embodied.data.lerobot_stats import aggregate_stats, stats_to_numpy

EPISODES_PATH = "meta/episodes.jsonl"
TASKS_PATH = "meta/tasks.jsonl"
EPISODES_STATS_PATH = "meta/episodes_stats.jsonl"
STATS_PATH = "meta/stats.json"
DEFAULT_CHUNK_SIZE = 1000


def _field(path: Path, row: dict, key: str, n: int):
    if key not in row:
        raise UserError(f"{path}:{n} has no `{key}`")
    return row[key]


def load_v21(root: Path, info: dict) -> LeRobotMeta:
    chunks_size = info.get("chunks_size", DEFAULT_CHUNK_SIZE)
    video_keys = [k for k, ft in info["features"].items() if ft.get("dtype") == "video"]

    tasks_path = root / TASKS_PATH
    tasks = {}
    for n, row in enumerate(read_jsonl(tasks_path, "the task strings"), 1):
        tasks[int(_field(tasks_path, row, "task_index", n))] = str(_field(tasks_path, row, "task", n))

    episodes_path = root / EPISODES_PATH
    rows = read_jsonl(episodes_path, "the episode list")
    indexed = []
    for n, row in enumerate(rows, 1):
        indexed.append((int(_field(episodes_path, row, "episode_index", n)), int(_field(episodes_path, row, "length", n)), row))
    indexed.sort(key=lambda t: t[0])
    if len({i for i, _, _ in indexed}) != len(indexed):
        raise UserError(f"{episodes_path}: an episode_index appears more than once")

    episodes, start = [], 0
    for ep_index, length, row in indexed:
        chunk = ep_index // chunks_size
        videos = {
            key: VideoSpan(format_path(root, info, "video_path", episode_chunk=chunk, video_key=key, episode_index=ep_index))
            for key in video_keys
        }
        data_path = format_path(root, info, "data_path", episode_chunk=chunk, episode_index=ep_index)
        episodes.append(Episode(ep_index, start, start + length, tuple(row.get("tasks") or ()), data_path, 0, videos))
        start += length
    check_ranges(root, info, episodes)

    per_episode: dict[int, dict] = {}
    stats_path = root / EPISODES_STATS_PATH
    if stats_path.is_file():
        for n, row in enumerate(read_jsonl(stats_path, "per-episode stats"), 1):
            per_episode[int(_field(stats_path, row, "episode_index", n))] = stats_to_numpy(_field(stats_path, row, "stats", n))
        stats = aggregate_stats(per_episode[ep.index] for ep in episodes if ep.index in per_episode)
    elif (root / STATS_PATH).is_file():  # written by v2.0; v2.1 keeps only the per-episode file
        stats = stats_to_numpy(read_json(root / STATS_PATH, "dataset stats"))
    else:
        stats = {}

    episode_stats = partial(_episode_stats, stats_path, [ep.index for ep in episodes], per_episode)
    return LeRobotMeta(root, "v2.1", info, dict(info["features"]), episodes, tasks, stats, episode_stats)


def _episode_stats(path: Path, indices: list[int], per_episode: dict[int, dict], i: int) -> dict:
    if indices[i] not in per_episode:
        raise UserError(f"{path}: no stats for episode {indices[i]}")
    return per_episode[indices[i]]
