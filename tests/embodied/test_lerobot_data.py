"""LeRobotDataset on small datasets this module writes itself, in the v2.1 and v3.0 layouts, with
the camera encoded by PyAV in H.264 and AV1.

Each frame's picture encodes its global frame index k (left half gray 32*(k // 8) + 16, right half
32*(k % 8) + 16: steps of 32 levels, far beyond what lossy coding moves a flat block), so a test
can tell exactly which video frame the reader returned. The v3.0 videos are the v2.1 episode
files joined by stream copy (FFmpeg's concat demuxer), with `from_timestamp` the summed durations
before each episode, as LeRobot's converter and recorder build them.
"""

from __future__ import annotations

import json
import pickle
import shutil
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from loongforge.core.errors import UserError
from loongforge.embodied.data import LeRobotDataset
from loongforge.embodied.data.video_frames import VideoFile, decode_image

FPS = 10
H, W = 24, 32
CAM = "observation.images.cam"
LENGTHS = [12, 15, 10]  # episodes of 1.2 s, 1.5 s, 1.0 s
STARTS = np.cumsum([0] + LENGTHS[:-1]).tolist()
NUM_FRAMES = sum(LENGTHS)
TASKS = ["pick up the cube", "put the cube in the bowl"]
EPISODE_TASK = [0, 1, 0]
ENCODERS = {"h264": ("libx264", "libopenh264", "h264"), "av1": ("libsvtav1", "libaom-av1", "librav1e")}
ENCODER_OPTIONS = {
    "libx264": {"g": "5", "bf": "2", "crf": "18", "preset": "veryfast"},  # B-frames: decode order != display order
    "libsvtav1": {"g": "5", "crf": "30", "preset": "10"},
    "libaom-av1": {"g": "5", "crf": "30", "cpu-used": "8"},
}
assert NUM_FRAMES <= 64, "the two 8-level halves of a frame encode indices up to 63"


# ---- writing datasets ----------------------------------------------------------------------------


def frame_image(k: int) -> np.ndarray:
    image = np.empty((H, W, 3), np.uint8)
    image[:, : W // 2] = 32 * (k // 8) + 16
    image[:, W // 2 :] = 32 * (k % 8) + 16
    return image


def frame_index_of(image: np.ndarray) -> int:
    """The index a decoded frame encodes (reads the middle of each half, away from the edge)."""
    assert image.shape == (H, W, 3) and image.dtype == np.uint8, (image.shape, image.dtype)
    left = image[4:-4, 2 : W // 2 - 2].astype(float).mean()
    right = image[4:-4, W // 2 + 2 : -2].astype(float).mean()
    return int(round((left - 16) / 32)) * 8 + int(round((right - 16) / 32))


def state(k: int) -> list[float]:
    return [k + j / 10 for j in range(6)]


def action(k: int) -> list[float]:
    return [-k - j / 4 for j in range(4)]


def encode_episode(path: Path, encoder: str, indices: list[int]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as out:
        stream = out.add_stream(encoder, rate=FPS, options=ENCODER_OPTIONS.get(encoder, {}))
        stream.width, stream.height, stream.pix_fmt = W, H, "yuv420p"
        for n, k in enumerate(indices):
            frame = av.VideoFrame.from_ndarray(frame_image(k), format="rgb24")
            frame.pts, frame.time_base = n, Fraction(1, FPS)
            out.mux(stream.encode(frame))
        out.mux(stream.encode())


def concat_videos(paths: list[Path], out_path: Path) -> list[float]:
    """Join episode videos by stream copy; returns each input's duration (s)."""
    durations = []
    for p in paths:
        with av.open(str(p)) as c:
            s = c.streams.video[0]
            durations.append(float(s.duration * s.time_base))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    listing = out_path.with_suffix(".ffconcat")
    listing.write_text("ffconcat version 1.0\n" + "".join(f"file '{p.resolve()}'\n" for p in paths))
    with av.open(str(listing), format="concat", options={"safe": "0"}) as src, av.open(str(out_path), "w") as dst:
        s_in = src.streams.video[0]
        s_out = dst.add_stream_from_template(s_in, opaque=True)
        s_out.time_base = s_in.time_base
        for packet in src.demux(s_in):
            if packet.dts is None:
                continue
            packet.stream = s_out
            dst.mux(packet)
    listing.unlink()
    return durations


def episode_columns(e: int) -> dict[str, list]:
    ks = list(range(STARTS[e], STARTS[e] + LENGTHS[e]))
    return {
        "observation.state": [state(k) for k in ks],
        "action": [action(k) for k in ks],
        "timestamp": [f / FPS for f in range(LENGTHS[e])],
        "frame_index": list(range(LENGTHS[e])),
        "episode_index": [e] * LENGTHS[e],
        "index": ks,
        "task_index": [EPISODE_TASK[e]] * LENGTHS[e],
        "next.done": [f == LENGTHS[e] - 1 for f in range(LENGTHS[e])],
    }


SCHEMA = pa.schema(
    [
        ("observation.state", pa.list_(pa.float32(), 6)),  # fixed-size list
        ("action", pa.list_(pa.float32())),  # variable-size list: files of older `datasets` versions
        ("timestamp", pa.float32()),
        ("frame_index", pa.int64()),
        ("episode_index", pa.int64()),
        ("index", pa.int64()),
        ("task_index", pa.int64()),
        ("next.done", pa.bool_()),
    ]
)


def write_parquet(path: Path, episodes: list[int]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = {name: [] for name in SCHEMA.names}
    for e in episodes:
        for name, values in episode_columns(e).items():
            columns[name] += values
    pq.write_table(pa.table(columns, schema=SCHEMA), path)


def features(version: str, codec: str) -> dict:
    scalar = {"shape": [1], "names": None}
    fts = {
        "observation.state": {"dtype": "float32", "shape": [6], "names": [f"joint_{j}" for j in range(6)]},
        "action": {"dtype": "float32", "shape": [4], "names": [f"motor_{j}" for j in range(4)]},
        CAM: {
            "dtype": "video",
            "shape": [H, W, 3],
            "names": ["height", "width", "channels"],
            "info": {
                "video.height": H,
                "video.width": W,
                "video.codec": codec,
                "video.pix_fmt": "yuv420p",
                "video.is_depth_map": False,
                "video.fps": FPS,
                "video.channels": 3,
                "has_audio": False,
            },
        },
        "timestamp": {"dtype": "float32", **scalar},
        "frame_index": {"dtype": "int64", **scalar},
        "episode_index": {"dtype": "int64", **scalar},
        "index": {"dtype": "int64", **scalar},
        "task_index": {"dtype": "int64", **scalar},
        "next.done": {"dtype": "bool", **scalar},
    }
    if version == "v3.0":
        for ft in fts.values():
            if ft["dtype"] != "video":
                ft["fps"] = FPS
    return fts


def stats_of(e: int) -> dict:
    cols = episode_columns(e)
    out = {}
    for name in ("observation.state", "action", "timestamp", "frame_index", "index"):
        a = np.asarray(cols[name], dtype=np.float64).reshape(LENGTHS[e], -1)
        out[name] = {"min": a.min(0), "max": a.max(0), "mean": a.mean(0), "std": a.std(0), "count": [LENGTHS[e]]}
    images = np.stack([frame_image(k) for k in cols["index"]]).astype(np.float64) / 255  # (T, H, W, C)
    per_channel = {"min": images.min((0, 1, 2)), "max": images.max((0, 1, 2)), "mean": images.mean((0, 1, 2)), "std": images.std((0, 1, 2))}
    out[CAM] = {k: v.reshape(3, 1, 1) for k, v in per_channel.items()} | {"count": [LENGTHS[e]]}
    return {f: {k: np.asarray(v).tolist() for k, v in d.items()} for f, d in out.items()}


def all_stats() -> dict:
    """Stats over every frame, computed directly (not aggregated)."""
    cols = {name: sum((episode_columns(e)[name] for e in range(len(LENGTHS))), []) for name in ("observation.state", "action")}
    return {name: np.asarray(v, dtype=np.float64) for name, v in cols.items()}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_v21(root: Path, codec: str, videos: list[Path]) -> None:
    chunks_size = 2  # episodes 0, 1 in chunk-000, episode 2 in chunk-001
    (root / "meta").mkdir(parents=True)
    info = {
        "codebase_version": "v2.1",
        "robot_type": "test_arm",
        "total_episodes": len(LENGTHS),
        "total_frames": NUM_FRAMES,
        "total_tasks": len(TASKS),
        "total_videos": len(LENGTHS),
        "total_chunks": 2,
        "chunks_size": chunks_size,
        "fps": FPS,
        "splits": {"train": f"0:{len(LENGTHS)}"},
        "data_path": "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet",
        "video_path": "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4",
        "features": features("v2.1", codec),
    }
    (root / "meta/info.json").write_text(json.dumps(info, indent=4))
    write_jsonl(root / "meta/tasks.jsonl", [{"task_index": i, "task": t} for i, t in enumerate(TASKS)])
    write_jsonl(
        root / "meta/episodes.jsonl",
        [{"episode_index": e, "tasks": [TASKS[EPISODE_TASK[e]]], "length": n} for e, n in reversed(list(enumerate(LENGTHS)))],
    )  # out of order on purpose: the reader sorts by episode_index
    write_jsonl(root / "meta/episodes_stats.jsonl", [{"episode_index": e, "stats": stats_of(e)} for e in range(len(LENGTHS))])
    for e, video in enumerate(videos):
        chunk = e // chunks_size
        write_parquet(root / f"data/chunk-{chunk:03d}/episode_{e:06d}.parquet", [e])
        target = root / f"videos/chunk-{chunk:03d}/{CAM}/episode_{e:06d}.mp4"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(video, target)


def write_v30(root: Path, codec: str, videos: list[Path]) -> None:
    import pandas as pd  # only to write meta/tasks.parquet exactly as LeRobot does (the task as the index)

    (root / "meta").mkdir(parents=True)
    info = {
        "codebase_version": "v3.0",
        "robot_type": "test_arm",
        "total_episodes": len(LENGTHS),
        "total_frames": NUM_FRAMES,
        "total_tasks": len(TASKS),
        "chunks_size": 1,  # one file per chunk: file (0, 0), then (1, 0)
        "data_files_size_in_mb": 100,
        "video_files_size_in_mb": 200,
        "fps": FPS,
        "splits": {"train": f"0:{len(LENGTHS)}"},
        "data_path": "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet",
        "video_path": "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4",
        "features": features("v3.0", codec),
    }
    (root / "meta/info.json").write_text(json.dumps(info, indent=4))
    pd.DataFrame({"task_index": range(len(TASKS))}, index=pd.Index(TASKS, name="task")).to_parquet(root / "meta/tasks.parquet")

    data_files = {(0, 0): [0, 1], (1, 0): [2]}  # data and video files group the episodes differently
    video_files = {(0, 0): [0], (1, 0): [1, 2]}
    for (chunk, file), eps in data_files.items():
        write_parquet(root / f"data/chunk-{chunk:03d}/file-{file:03d}.parquet", eps)
    rows = [
        {
            "episode_index": e,
            "tasks": [TASKS[EPISODE_TASK[e]]],
            "length": LENGTHS[e],
            "data/chunk_index": next(c for (c, _), eps in data_files.items() if e in eps),
            "data/file_index": 0,
            "dataset_from_index": STARTS[e],
            "dataset_to_index": STARTS[e] + LENGTHS[e],
        }
        for e in range(len(LENGTHS))
    ]
    for (chunk, file), eps in video_files.items():
        durations = concat_videos([videos[e] for e in eps], root / f"videos/{CAM}/chunk-{chunk:03d}/file-{file:03d}.mp4")
        offset = 0.0
        for e, duration in zip(eps, durations):
            rows[e] |= {
                f"videos/{CAM}/chunk_index": chunk,
                f"videos/{CAM}/file_index": file,
                f"videos/{CAM}/from_timestamp": offset,
                f"videos/{CAM}/to_timestamp": offset + duration,
            }
            offset += duration
    for e, row in enumerate(rows):
        row |= {"meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0 if e < 2 else 1}
        for feature, d in stats_of(e).items():
            row |= {f"stats/{feature}/{name}": value for name, value in d.items()}
    (root / "meta/episodes/chunk-000").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows[:2]), root / "meta/episodes/chunk-000/file-000.parquet")
    pq.write_table(pa.Table.from_pylist(rows[2:]), root / "meta/episodes/chunk-000/file-001.parquet")
    stats = {}
    for name, values in all_stats().items():
        stats[name] = {"min": values.min(0), "max": values.max(0), "mean": values.mean(0), "std": values.std(0), "count": [len(values)]}
    (root / "meta/stats.json").write_text(json.dumps({f: {k: np.asarray(v).tolist() for k, v in d.items()} for f, d in stats.items()}))


# ---- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["h264", "av1"])
def codec(request) -> tuple[str, str]:
    name = request.param
    found = [e for e in ENCODERS[name] if e in av.codecs_available]
    for encoder in found:
        try:
            av.codec.Codec(encoder, "w")
            return name, encoder
        except (ValueError, av.error.FFmpegError):
            continue
    pytest.skip(f"this PyAV build has no {name} encoder (looked for {', '.join(ENCODERS[name])})")


@pytest.fixture(scope="module")
def episode_videos(codec, tmp_path_factory) -> list[Path]:
    name, encoder = codec
    folder = tmp_path_factory.mktemp(f"episodes_{name}")
    paths = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SVT_LOG", "1")  # SVT-AV1 prints its banner at info level otherwise
        for e, (start, n) in enumerate(zip(STARTS, LENGTHS)):
            paths.append(folder / f"episode_{e}.mp4")
            encode_episode(paths[-1], encoder, list(range(start, start + n)))
    return paths


@pytest.fixture(scope="module", params=["v2.1", "v3.0"])
def root(request, codec, episode_videos, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp(f"lerobot_{request.param}_{codec[0]}") / "dataset"
    (write_v21 if request.param == "v2.1" else write_v30)(path, codec[0], episode_videos)
    return path


@pytest.fixture
def h264_v21(tmp_path) -> Path:
    """A fresh v2.1 dataset (H.264) that a test may break."""
    encoder = next((e for e in ENCODERS["h264"] if e in av.codecs_available), None)
    if encoder is None:
        pytest.skip("this PyAV build has no H.264 encoder")
    videos = []
    for e, (start, n) in enumerate(zip(STARTS, LENGTHS)):
        videos.append(tmp_path / f"episode_{e}.mp4")
        encode_episode(videos[-1], encoder, list(range(start, start + n)))
    write_v21(tmp_path / "dataset", "h264", videos)
    return tmp_path / "dataset"


def parquet_rows(root: Path) -> dict[str, list]:
    """Every data column over the whole dataset, read straight from the parquet files in order."""
    files = sorted((root / "data").glob("*/*.parquet"))
    tables = [pq.read_table(f) for f in files]
    table = pa.concat_tables(tables)
    return {name: table.column(name).to_pylist() for name in table.column_names}


# ---- tests --------------------------------------------------------------------------------------


def test_metadata(root):
    ds = LeRobotDataset(root)
    version = root.parent.name.split("_")[1]
    assert ds.version == version
    assert ds.fps == FPS and ds.num_episodes == len(LENGTHS) and ds.num_frames == len(ds) == NUM_FRAMES
    assert ds.video_keys == [CAM] and ds.features[CAM]["shape"] == [H, W, 3]
    assert ds.tasks == dict(enumerate(TASKS))
    for e in range(len(LENGTHS)):
        ep = ds.episode(e)
        assert (ep.index, ep.start, ep.stop, ep.length) == (e, STARTS[e], STARTS[e] + LENGTHS[e], LENGTHS[e])
        assert ep.tasks == (TASKS[EPISODE_TASK[e]],)
        assert ds.episode_of(ep.start) == ep and ds.episode_of(ep.stop - 1) == ep
        assert ds.episode_stats(e)["observation.state"]["count"].tolist() == [LENGTHS[e]]
    if version == "v3.0":  # episode 2 starts 1.5 s into the second video file, after episode 1
        assert ds.episode(2).videos[CAM].from_timestamp == pytest.approx(LENGTHS[1] / FPS)
        assert ds.episode(1).videos[CAM].path == ds.episode(2).videos[CAM].path != ds.episode(0).videos[CAM].path
    with pytest.raises(IndexError):
        ds.episode(len(LENGTHS))
    # v2.1 aggregates the per-episode stats, v3.0 reads meta/stats.json: both are the stats of all frames
    for name, values in all_stats().items():
        got = ds.stats[name]
        np.testing.assert_allclose(got["mean"], values.mean(0), rtol=1e-6)
        np.testing.assert_allclose(got["std"], values.std(0), rtol=1e-6)
        np.testing.assert_allclose(got["min"], values.min(0))
        np.testing.assert_allclose(got["max"], values.max(0))
        assert got["count"].tolist() == [NUM_FRAMES]


def test_every_frame_is_exact_in_order_and_shuffled(root):
    ds = LeRobotDataset(root)
    rows = parquet_rows(root)
    order = list(range(NUM_FRAMES)) + np.random.default_rng(0).permutation(NUM_FRAMES).tolist()
    for i in order:
        item = ds[i]
        frame = item[CAM]
        assert frame.shape == (H, W, 3) and frame.dtype == np.uint8
        assert frame_index_of(frame) == i, f"dataset[{i}] returned video frame {frame_index_of(frame)}"
        e = int(np.searchsorted(STARTS, i, side="right")) - 1
        assert item["task"] == TASKS[EPISODE_TASK[e]]
        assert set(item) == set(ds.features) | {"task"}
        for name, column in rows.items():  # every non-video feature equals its parquet cell
            expected = column[i]
            got = item[name]
            if isinstance(expected, list):
                assert isinstance(got, np.ndarray) and got.dtype == np.float32 and got.shape == (len(expected),)
                np.testing.assert_array_equal(got, np.asarray(expected, dtype=np.float32))
            else:
                assert got == expected and isinstance(got, np.generic), (name, got, expected)
        assert item["index"] == i and item["episode_index"] == e
    assert ds[-1]["index"] == NUM_FRAMES - 1
    with pytest.raises(IndexError):
        ds[NUM_FRAMES]


def test_window_clamps_and_pads_at_episode_edges(root):
    ds = LeRobotDataset(root)
    deltas = {
        "observation.state": [-0.2, -0.1, 0.0],
        "action": [0.0, 0.1, 0.2, 0.3],
        CAM: [-0.1, 0.0, 0.1],
        "timestamp": [-0.1, 0.0],
    }
    steps = {key: np.round(np.asarray(v) * FPS).astype(int) for key, v in deltas.items()}
    ep = ds.episode(1)
    for i in (ep.start, ep.start + 1, ep.start + 5, ep.stop - 2, ep.stop - 1):
        win = ds.window(i, deltas)
        assert set(win) == set(deltas) | {f"{k}_is_pad" for k in deltas}
        for key, d in steps.items():
            wanted = i + d
            pad = (wanted < ep.start) | (wanted >= ep.stop)
            clamped = np.clip(wanted, ep.start, ep.stop - 1)
            assert win[f"{key}_is_pad"].dtype == bool
            np.testing.assert_array_equal(win[f"{key}_is_pad"], pad)
            if key == CAM:
                assert win[key].shape == (len(d), H, W, 3) and win[key].dtype == np.uint8
                assert [frame_index_of(f) for f in win[key]] == clamped.tolist()
            elif key == "timestamp":
                np.testing.assert_allclose(win[key], (clamped - ep.start) / FPS, rtol=1e-6)
            else:
                values = np.stack([(state if key == "observation.state" else action)(k) for k in clamped]).astype(np.float32)
                np.testing.assert_array_equal(win[key], values)
    first, last = ds.window(ep.start, deltas), ds.window(ep.stop - 1, deltas)
    assert first["observation.state_is_pad"].tolist() == [True, True, False]
    assert first[f"{CAM}_is_pad"].tolist() == [True, False, False]
    assert last["action_is_pad"].tolist() == [False, True, True, True]
    assert last[f"{CAM}_is_pad"].tolist() == [False, False, True]


def test_delta_timestamps_in_getitem(root):
    deltas = {"action": [0.0, 0.1], CAM: [-0.1, 0.0]}
    ds = LeRobotDataset(root, delta_timestamps=deltas)
    item = ds[STARTS[2]]
    assert item["action"].shape == (2, 4) and item["action_is_pad"].tolist() == [False, False]
    assert item[CAM].shape == (2, H, W, 3) and item[f"{CAM}_is_pad"].tolist() == [True, False]
    assert [frame_index_of(f) for f in item[CAM]] == [STARTS[2], STARTS[2]]
    assert item["observation.state"].shape == (6,) and item["task"] == TASKS[EPISODE_TASK[2]]
    again = pickle.loads(pickle.dumps(ds))  # as DataLoader workers receive it
    assert frame_index_of(again[5][CAM][1]) == 5


def test_selected_keys_and_missing_feature(root):
    ds = LeRobotDataset(root)
    assert set(ds.get(3, keys=["action", "task"])) == {"action", "task"}
    with pytest.raises(UserError, match=r"'observation\.images\.wrist'"):
        ds.get(0, keys=["observation.images.wrist"])
    with pytest.raises(UserError, match=r"unknown feature 'observation\.images\.wrist'"):
        ds.window(0, {"observation.images.wrist": [0.0]})
    with pytest.raises(UserError, match=r"unknown feature 'actions'"):
        LeRobotDataset(root, delta_timestamps={"actions": [0.0]})


def test_offsets_must_be_whole_frames(root):
    ds = LeRobotDataset(root)
    with pytest.raises(UserError, match=r"delta_timestamps\['action'\]: \[0\.05\] not multiples of 1/fps = 0\.1 s"):
        ds.window(0, {"observation.state": [0.0], "action": [0.0, 0.05]})
    ds.window(0, {"action": [0.1 + 5e-5]})  # within the 1e-4 s tolerance
    with pytest.raises(UserError, match=r"delta_timestamps\['action'\]: expected a non-empty list"):
        ds.window(0, {"action": []})


def test_version_and_file_errors(h264_v21, tmp_path):
    info_path = h264_v21 / "meta/info.json"
    info = json.loads(info_path.read_text())

    with pytest.raises(UserError, match=r"meta/info\.json not found"):
        LeRobotDataset(tmp_path)
    for version, message in (
        ("v2.0", r"unsupported LeRobot codebase_version 'v2\.0' \(supported: v2\.1, v3\.0\)"),
        (None, "no codebase_version"),
    ):
        bad = dict(info)
        if version is None:
            del bad["codebase_version"]
        else:
            bad["codebase_version"] = version
        info_path.write_text(json.dumps(bad))
        with pytest.raises(UserError, match=message) as err:
            LeRobotDataset(h264_v21)
        assert str(info_path) in str(err.value) and "\n" not in str(err.value)
    info_path.write_text(json.dumps(info))

    (h264_v21 / "meta/tasks.jsonl").rename(h264_v21 / "meta/tasks.jsonl.bak")
    with pytest.raises(UserError, match=r"meta/tasks\.jsonl not found"):
        LeRobotDataset(h264_v21)
    (h264_v21 / "meta/tasks.jsonl.bak").rename(h264_v21 / "meta/tasks.jsonl")

    ds = LeRobotDataset(h264_v21)
    video = h264_v21 / f"videos/chunk-001/{CAM}/episode_000002.mp4"
    video.unlink()
    with pytest.raises(UserError, match=f"{video} not found"):
        ds[STARTS[2]]
    assert frame_index_of(ds[0][CAM]) == 0  # other episodes still read
    data = h264_v21 / "data/chunk-000/episode_000001.parquet"
    data.unlink()
    with pytest.raises(UserError, match=f"{data} not found"):
        ds[STARTS[1]]

    info["total_frames"] = NUM_FRAMES + 1
    info_path.write_text(json.dumps(info))
    with pytest.raises(UserError, match=f"total_frames is {NUM_FRAMES + 1} but the episodes hold {NUM_FRAMES} frames"):
        LeRobotDataset(h264_v21)


def test_v30_missing_episode_table(tmp_path):
    (tmp_path / "meta").mkdir()
    (tmp_path / "meta/info.json").write_text(json.dumps({"codebase_version": "v3.0", "fps": FPS, "features": features("v3.0", "h264")}))
    with pytest.raises(UserError, match=r"meta/episodes: no chunk-\*/file-\*\.parquet \(the episode table\) found"):
        LeRobotDataset(tmp_path)


def test_seek_that_lands_late_is_retried_and_missing_times_are_errors(codec, tmp_path, monkeypatch):
    """A demuxer may put a seek on a keyframe shown after the time asked for (B-frames): the reader
    seeks again from further back. A time with no frame within half a period is an error."""
    path = tmp_path / "video.mp4"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SVT_LOG", "1")
        encode_episode(path, codec[1], list(range(20)))
    seeks = []
    real_seek = VideoFile._seek

    def late_first_seek(self, t):
        seeks.append(t)
        real_seek(self, t + 0.35 if len(seeks) == 1 else t)

    monkeypatch.setattr(VideoFile, "_seek", late_first_seek)
    video = VideoFile(path, FPS)
    assert frame_index_of(video.frame_at(1.2)) == 12
    assert len(seeks) == 2 and seeks[1] < seeks[0]
    assert frame_index_of(video.frame_at(1.3 + 0.04)) == 13  # within half a period of frame 13
    with pytest.raises(UserError, match=f"{path}: no video frame within 0.0500 s of t=5.0000 s"):
        video.frame_at(5.0)
    assert frame_index_of(video.frame_at(0.0)) == 0  # and it recovers
    video.close()


def test_image_feature_cell_decodes():
    """An `image` feature's cell ({"bytes": PNG, "path"}) decodes to the same pixels."""
    import io

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="image2pipe") as out:
        stream = out.add_stream("png", rate=1)
        stream.width, stream.height, stream.pix_fmt = W, H, "rgb24"
        out.mux(stream.encode(av.VideoFrame.from_ndarray(frame_image(42), format="rgb24")))
        out.mux(stream.encode())
    image = decode_image({"bytes": buffer.getvalue(), "path": None}, Path("."), "observation.image")
    np.testing.assert_array_equal(image, frame_image(42))
    with pytest.raises(UserError, match="'observation.image'"):
        decode_image({"bytes": None, "path": None}, Path("."), "observation.image")
