"""`LeRobotDataset`: frames of a local LeRobot dataset (v2.1 or v3.0) by global frame index.

    ds = LeRobotDataset("path/to/dataset")
    item = ds[i]          # every non-video feature, each camera's frame (uint8 HWC RGB), "task"
    win = ds.window(i, {"observation.state": [-0.1, 0.0], "action": [0.0, 0.1, 0.2]})
    # win["action"]: (3, *shape), win["action_is_pad"]: (3,) bool

Reads parquet with pyarrow and video with PyAV; the `lerobot` package is not needed. A camera's
frame is the one whose pts is within half a frame period of the frame's `timestamp` (plus, for
v3.0, the episode's `from_timestamp` in the shared video file). Open parquet tables and video
containers are cached per file (least recently used first out), per process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from loongforge.core.errors import UserError
from loongforge.embodied.data.delta_timestamps import DEFAULT_TOLERANCE_S, to_frame_deltas, window_rows
from loongforge.embodied.data.file_cache import FileCache
from loongforge.embodied.data.lerobot_meta import Episode, load_meta
from loongforge.embodied.data.parquet_frames import DataFile
from loongforge.embodied.data.video_frames import VideoFile, decode_image


class LeRobotDataset:
    """A local LeRobot dataset. `delta_timestamps`, when given, makes `ds[i]` also hold the
    windows of `window(i, delta_timestamps)` in place of those keys' single values (LeRobot's
    behaviour); `max_open_files` bounds the parquet tables and the video containers kept open."""

    def __init__(
        self,
        root: str | Path,
        delta_timestamps: Mapping[str, Sequence[float]] | None = None,
        tolerance_s: float = DEFAULT_TOLERANCE_S,
        max_open_files: int = 16,
    ):
        self.meta = load_meta(root)
        self.root = self.meta.root
        self.tolerance_s = tolerance_s
        self.max_open_files = max_open_files
        self._starts = np.array([ep.start for ep in self.meta.episodes], dtype=np.int64)
        self.delta_timestamps = None if delta_timestamps is None else dict(delta_timestamps)
        self._deltas = None if delta_timestamps is None else self._frame_deltas(delta_timestamps)
        self._open_caches()

    def _open_caches(self) -> None:
        self._data_files: FileCache[DataFile] = FileCache(self.max_open_files)
        self._video_files: FileCache[VideoFile] = FileCache(self.max_open_files, close=VideoFile.close)

    # ---- metadata
    @property
    def version(self) -> str:
        return self.meta.version

    @property
    def fps(self) -> int | float:
        return self.meta.fps

    @property
    def features(self) -> dict[str, dict]:
        return self.meta.features

    @property
    def video_keys(self) -> list[str]:
        return self.meta.video_keys

    @property
    def num_episodes(self) -> int:
        return len(self.meta.episodes)

    @property
    def num_frames(self) -> int:
        return self.meta.num_frames

    @property
    def tasks(self) -> dict[int, str]:
        """task_index -> task string."""
        return self.meta.tasks

    @property
    def stats(self) -> dict[str, dict[str, np.ndarray]]:
        return self.meta.stats

    def episode(self, i: int) -> Episode:
        """The i-th episode (in episode_index order): its global frame range [start, stop) and files."""
        if not -self.num_episodes <= i < self.num_episodes:
            raise IndexError(f"episode {i} out of range (the dataset has {self.num_episodes})")
        return self.meta.episodes[i]

    def episode_stats(self, i: int) -> dict[str, dict[str, np.ndarray]]:
        """The i-th episode's stats ({feature: {stat: array}})."""
        self.episode(i)
        return self.meta.episode_stats(i % self.num_episodes)

    def episode_of(self, index: int) -> Episode:
        """The episode holding global frame `index`."""
        return self.meta.episodes[int(np.searchsorted(self._starts, self._check_index(index), side="right")) - 1]

    def __len__(self) -> int:
        return self.num_frames

    def __repr__(self) -> str:
        return (
            f"LeRobotDataset({str(self.root)!r}, version={self.version}, fps={self.fps}, "
            f"episodes={self.num_episodes}, frames={self.num_frames}, cameras={self.video_keys})"
        )

    # ---- frames
    def __getitem__(self, index: int) -> dict[str, Any]:
        item = self.get(index)
        if self._deltas is not None:
            item.update(self._window(self._check_index(index), self._deltas))
        return item

    def get(self, index: int, keys: Iterable[str] | None = None) -> dict[str, Any]:
        """Frame `index`: each feature in `keys` (default: all of them) and "task" (when `keys` is
        None or names it); cameras decoded to uint8 HWC RGB."""
        i = self._check_index(index)
        wanted = list(self.features) if keys is None else self._check_keys(keys, allow=("task",))
        ep = self.episode_of(i)
        data, row = self._data_row(ep, i)
        item: dict[str, Any] = {}
        for key in wanted:
            if key == "task":
                continue
            dtype = self.features[key].get("dtype")
            if dtype == "video":
                item[key] = self._video(ep, key).frame_at(ep.videos[key].from_timestamp + self._timestamps(ep, data, [row])[0])
            elif dtype == "image":
                item[key] = decode_image(data.value(key, row), self.root, key)
            else:
                item[key] = data.value(key, row)
        if keys is None or "task" in wanted:
            item["task"] = self._task(ep, data, row)
        return item

    def window(self, index: int, delta_timestamps: Mapping[str, Sequence[float]]) -> dict[str, Any]:
        """For each key, its values at frame `index` + each offset (s), clamped to the frame's
        episode and stacked on a new first axis, and `<key>_is_pad` (bool) where the offset fell
        outside the episode. Offsets must be multiples of 1/fps (within `tolerance_s`)."""
        return self._window(self._check_index(index), self._frame_deltas(delta_timestamps))

    def close(self) -> None:
        """Close the open parquet tables and video containers (they reopen on the next read)."""
        self._data_files.clear()
        self._video_files.clear()

    def __enter__(self) -> LeRobotDataset:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getstate__(self) -> dict:  # picklable for DataLoader workers: open files stay behind
        state = dict(self.__dict__)
        state.pop("_data_files")
        state.pop("_video_files")
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._open_caches()

    # ---- internals
    def _check_index(self, index: int) -> int:
        if isinstance(index, (bool, np.bool_)) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"frame index must be an int, got {type(index).__name__}")
        i = int(index)
        if not -self.num_frames <= i < self.num_frames:
            raise IndexError(f"frame {i} out of range (the dataset has {self.num_frames} frames)")
        return i + self.num_frames if i < 0 else i

    def _check_keys(self, keys: Iterable[str], allow: Sequence[str] = ()) -> list[str]:
        keys = [keys] if isinstance(keys, str) else list(keys)
        for key in keys:
            if key not in self.features and key not in allow:
                raise UserError(f"{self.root}: no feature or camera {key!r} (it has: {', '.join(self.features)})")
        return keys

    def _frame_deltas(self, delta_timestamps: Mapping[str, Sequence[float]]) -> dict[str, np.ndarray]:
        return to_frame_deltas(delta_timestamps, self.fps, known=self.features, tolerance_s=self.tolerance_s)

    def _data_row(self, ep: Episode, i: int) -> tuple[DataFile, int]:
        data = self._data_files.get(ep.data_path, lambda: DataFile(ep.data_path, self.features))
        last = ep.data_row + ep.length - 1
        if ep.length and last >= data.num_rows:
            raise UserError(f"{ep.data_path} has {data.num_rows} rows, episode {ep.index} needs rows up to {last}")
        row = ep.data_row + (i - ep.start)
        if "index" in data.table.column_names and int(data.value("index", row)) != i:
            raise UserError(f"{ep.data_path}: row {row} holds frame index {int(data.value('index', row))}, the metadata expects {i}")
        return data, row

    def _timestamps(self, ep: Episode, data: DataFile, rows: Sequence[int]) -> list[float]:
        """The in-episode times (s) of `rows`: the `timestamp` column, else frame position / fps."""
        if "timestamp" in data.table.column_names:
            return [float(t) for t in np.asarray(data.values("timestamp", rows), dtype=np.float64).reshape(len(rows))]
        return [(r - ep.data_row) / self.fps for r in rows]

    def _video(self, ep: Episode, key: str) -> VideoFile:
        span = ep.videos.get(key)
        if span is None:
            raise UserError(f"{self.root}: episode {ep.index} has no video for camera {key!r}")
        return self._video_files.get(span.path, lambda: VideoFile(span.path, self.fps))

    def _task(self, ep: Episode, data: DataFile, row: int) -> str | None:
        if "task_index" not in data.table.column_names:
            return ep.tasks[0] if len(ep.tasks) == 1 else None
        task_index = int(data.value("task_index", row))
        if task_index not in self.tasks:
            raise UserError(f"{ep.data_path}: row {row} has task_index {task_index}, which the dataset's task list lacks")
        return self.tasks[task_index]

    def _window(self, i: int, deltas: Mapping[str, np.ndarray]) -> dict[str, Any]:
        ep = self.episode_of(i)
        data, _ = self._data_row(ep, i)
        out: dict[str, Any] = {}
        for key, d in deltas.items():
            frames, pad = window_rows(i, ep.start, ep.stop, d)
            rows = [ep.data_row + int(f - ep.start) for f in frames]
            dtype = self.features[key].get("dtype")
            if dtype == "video":
                video, offset = self._video(ep, key), ep.videos[key].from_timestamp
                times = self._timestamps(ep, data, rows)
                decoded = {t: video.frame_at(offset + t) for t in sorted(set(times))}  # in time order: decode forward once
                out[key] = np.stack([decoded[t] for t in times])
            elif dtype == "image":
                out[key] = np.stack([decode_image(data.value(key, r), self.root, key) for r in rows])
            else:
                out[key] = _stacked(data.values(key, rows))
            out[f"{key}_is_pad"] = pad
        return out


def _stacked(values):
    """Equal-shape arrays as one array; anything else (strings, ragged lists) as it is."""
    if isinstance(values, list) and values and all(isinstance(v, np.ndarray) for v in values):
        try:
            return np.stack(values)
        except ValueError:
            pass
    return values
