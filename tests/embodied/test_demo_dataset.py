"""`write_demo_dataset`: the LeRobot v3.0 demo dataset reads back with `LeRobotDataset`, its pictures
show its states, its stats are those of its data, and writing it is atomic and never touches a
directory it did not write.

Where a square lies in a picture is computed here from the module docstring's formula (not from the
module's code), and found in the decoded frame as the centroid of the pixels of its colour.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import av
import numpy as np
import pyarrow.parquet as pq
import pytest
from loongforge.core.errors import UserError
from loongforge.embodied.data import LeRobotDataset, compute_stats, write_demo_dataset
from loongforge.embodied.data import demo_dataset as demo

EPISODES, FRAMES, FPS, SIZE = 8, 40, 10, 32
TOP, WRIST = "observation.images.top", "observation.images.wrist"
TASKS = {0: "move to the red square", 1: "move to the blue square"}
PIXEL_TOLERANCE = 1.5
SMALL = {"episodes": 2, "frames": 10}  # for the datasets a test writes for itself


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("demo") / "dataset"
    assert write_demo_dataset(path) == path
    return path


def pixel(x: float, y: float, span: float, size: int = SIZE) -> np.ndarray:
    """(column, row) of world point (x, y) in a picture showing [-span, span]^2 (the docstring's formula)."""
    m = max(5, size // 6) / 2
    return np.array([m + (x + span) / (2 * span) * (size - 1 - 2 * m), m + (span - y) / (2 * span) * (size - 1 - 2 * m)])


def centroid(image: np.ndarray, channel: int) -> np.ndarray:
    """(column, row) centroid of the pixels where `channel` (0 red, 1 green, 2 blue) dominates."""
    img = image.astype(np.float64)
    others = [c for c in range(3) if c != channel]
    weight = np.clip(img[..., channel] - np.maximum(img[..., others[0]], img[..., others[1]]) - 60, 0, None)
    assert weight.sum() > 0, f"no pixels of colour channel {channel} in the picture"
    rows, columns = np.mgrid[: image.shape[0], : image.shape[1]]
    return np.array([(weight * columns).sum(), (weight * rows).sum()]) / weight.sum()


def data_columns(path: Path) -> dict[str, np.ndarray]:
    table = pq.read_table(path / "data/chunk-000/file-000.parquet")
    return {name: np.asarray(table.column(name).to_pylist(), dtype=np.float64) for name in table.column_names}


def snapshot(path: Path) -> dict[str, tuple]:
    return {str(p.relative_to(path)): (p.stat().st_mtime_ns, p.stat().st_size, p.stat().st_ino) for p in [path, *path.rglob("*")]}


# ---- what is written ----------------------------------------------------------------------------


def test_layout_and_metadata(root):
    ds = LeRobotDataset(root)
    assert (ds.version, ds.fps, ds.num_episodes, ds.num_frames) == ("v3.0", FPS, EPISODES, EPISODES * FRAMES)
    assert ds.video_keys == [TOP, WRIST] and ds.tasks == TASKS
    assert ds.features["observation.state"]["shape"] == [4] and ds.features["action"]["shape"] == [2]
    info = json.loads((root / "meta/info.json").read_text())
    assert info["codebase_version"] == "v3.0" and info["chunks_size"] >= 1 and info["total_frames"] == EPISODES * FRAMES
    assert info["data_path"] == "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
    assert info["video_path"] == "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
    assert info["loongforge_demo"] == {
        "format": demo.DEMO_FORMAT,
        "episodes": EPISODES,
        "frames": FRAMES,
        "fps": FPS,
        "image_size": SIZE,
        "seed": 0,
    }
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) == sorted(
        [
            "meta/info.json",
            "meta/tasks.parquet",
            "meta/stats.json",
            "meta/episodes/chunk-000/file-000.parquet",
            "data/chunk-000/file-000.parquet",
            f"videos/{TOP}/chunk-000/file-000.mp4",
            f"videos/{WRIST}/chunk-000/file-000.mp4",
        ]
    )
    for e in range(EPISODES):  # every episode in the one data file and, one after the other, the one video file per camera
        ep = ds.episode(e)
        assert (ep.start, ep.stop, ep.tasks, ep.data_row) == (e * FRAMES, (e + 1) * FRAMES, (TASKS[e % 2],), e * FRAMES)
        for key in (TOP, WRIST):
            span = ep.videos[key]
            assert span.path == root / f"videos/{key}/chunk-000/file-000.mp4"
            assert span.from_timestamp == pytest.approx(e * FRAMES / FPS) and span.to_timestamp == pytest.approx((e + 1) * FRAMES / FPS)
    columns = set(pq.read_schema(root / "meta/episodes/chunk-000/file-000.parquet").names)
    for feature in ds.features:
        assert {f"stats/{feature}/{s}" for s in ("mean", "std", "min", "max", "count")} <= columns, feature
    for key in (TOP, WRIST):
        assert ds.features[key]["info"]["video.codec"] == "h264" and ds.features[key]["shape"] == [SIZE, SIZE, 3]
        with av.open(str(root / f"videos/{key}/chunk-000/file-000.mp4")) as container:
            stream = container.streams.video[0]
            assert (stream.codec_context.name, stream.codec_context.pix_fmt) == ("h264", "yuv420p")
            assert (stream.width, stream.height) == (SIZE, SIZE)
            assert sum(1 for _ in container.decode(stream)) == EPISODES * FRAMES
    import pandas as pd  # LeRobot reads the task strings as the pandas index

    assert pd.read_parquet(root / "meta/tasks.parquet")["task_index"].to_dict() == {t: i for i, t in TASKS.items()}


def test_every_frame_decodes_and_shows_its_state(root):
    """Every frame of both cameras decodes; the top camera shows the point, and the square of the
    task's colour at the target, where the state says; the wrist camera shows the point in its
    centre and the target at its offset. Comparing each picture with the state one frame before
    or after, and each episode's first picture with the other episodes' scenes, shows the check
    tells frames apart."""
    ds = LeRobotDataset(root)
    own, shifted = [], []
    first_scenes, first_pictures = [], []
    for e in range(EPISODES):
        ep = ds.episode(e)
        states = np.stack([ds.get(i, keys=["observation.state"])["observation.state"] for i in range(ep.start, ep.stop)]).astype(np.float64)
        target_channel = 0 if e % 2 == 0 else 2
        other_channel = 2 if e % 2 == 0 else 0
        for t, i in enumerate(range(ep.start, ep.stop)):
            item = ds.get(i, keys=[TOP, WRIST, "task_index"])
            assert item["task_index"] == e % 2
            for key in (TOP, WRIST):
                assert item[key].shape == (SIZE, SIZE, 3) and item[key].dtype == np.uint8
            x, y, tx, ty = states[t]
            point = centroid(item[TOP], 1)
            error = np.abs(point - pixel(x, y, 1.0)).max()
            assert error <= PIXEL_TOLERANCE, (
                f"frame {i} (episode {e}, first frame {t == 0}, last {t == FRAMES - 1}): point {error:.2f} px off"
            )
            own.append(error)
            if 0 < t < 8:  # the point moves about MAX_SPEED / FPS per frame early on
                shifted += [np.abs(point - pixel(*states[t + d, :2], 1.0)).max() for d in (-1, 1)]
            if t == 0:  # the point is at least 0.8 from the target: the squares do not overlap it
                target = centroid(item[TOP], target_channel)
                assert np.abs(target - pixel(tx, ty, 1.0)).max() <= PIXEL_TOLERANCE, f"episode {e}: the target is not the {TASKS[e % 2]!r}"
                np.testing.assert_allclose(centroid(item[WRIST], 1), [(SIZE - 1) / 2] * 2, atol=PIXEL_TOLERANCE)
                np.testing.assert_allclose(centroid(item[WRIST], target_channel), pixel(tx - x, ty - y, 2.0), atol=PIXEL_TOLERANCE)
                first_scenes.append(np.concatenate([pixel(x, y, 1.0), pixel(tx, ty, 1.0)]))
                first_pictures.append(np.concatenate([point, target, centroid(item[TOP], other_channel)]))
    assert np.mean(shifted) > np.mean(own) + 0.5, (np.mean(own), np.mean(shifted))
    for e, picture in enumerate(first_pictures):  # each first picture matches its own episode's scene only
        errors = [np.abs(picture[:4] - scene).max() for scene in first_scenes]
        assert int(np.argmin(errors)) == e and sorted(errors)[1] > 2 * PIXEL_TOLERANCE, (e, errors)


def test_stats_are_those_of_the_data(root):
    ds = LeRobotDataset(root)
    columns = data_columns(root)
    stats = json.loads((root / "meta/stats.json").read_text())
    quantiles = {"q01": 0.01, "q10": 0.10, "q50": 0.50, "q90": 0.90, "q99": 0.99}
    for name in ("observation.state", "action", "timestamp", "frame_index", "episode_index", "index", "task_index"):
        values = columns[name].reshape(len(columns[name]), -1)
        got = stats[name]
        for stat, fn in (("mean", np.mean), ("std", np.std), ("min", np.min), ("max", np.max)):
            np.testing.assert_allclose(got[stat], fn(values, axis=0), rtol=1e-9, atol=1e-12, err_msg=f"{name} {stat}")
        assert got["count"] == [EPISODES * FRAMES]
        if name in ("observation.state", "action"):
            for stat, q in quantiles.items():
                np.testing.assert_allclose(got[stat], np.quantile(values, q, axis=0), rtol=1e-9, atol=1e-12, err_msg=f"{name} {stat}")
        for e in (0, 3, EPISODES - 1):
            part = values[e * FRAMES : (e + 1) * FRAMES]
            episode = ds.episode_stats(e)[name]
            np.testing.assert_allclose(episode["mean"], part.mean(0), rtol=1e-9, atol=1e-12)
            np.testing.assert_allclose(episode["max"], part.max(0), rtol=1e-9, atol=1e-12)
            assert episode["count"].tolist() == [FRAMES]
    computed = compute_stats(ds, ["observation.state", "action"])  # the reader's own stats agree
    for name, d in computed.items():
        for stat, value in d.items():
            np.testing.assert_allclose(ds.stats[name][stat], value, rtol=1e-6, atol=1e-9, err_msg=f"{name} {stat}")
    for key in (TOP, WRIST):  # per channel on [0, 1], from the frames as drawn: close to the decoded ones
        decoded = np.stack([ds.get(i, keys=[key])[key] for i in range(0, EPISODES * FRAMES, 7)]).astype(np.float64) / 255
        assert ds.stats[key]["mean"].shape == (3, 1, 1) and ds.stats[key]["count"].tolist() == [EPISODES * FRAMES]
        np.testing.assert_allclose(ds.stats[key]["mean"].reshape(3), decoded.mean((0, 1, 2)), atol=0.01)
        np.testing.assert_allclose(ds.stats[key]["std"].reshape(3), decoded.std((0, 1, 2)), atol=0.02)
        assert np.all(ds.stats[key]["min"] >= 0) and np.all(ds.stats[key]["max"] <= 1)
        assert ds.episode_stats(2)[key]["count"].tolist() == [FRAMES]


def test_actions_drive_the_point_to_the_target(root):
    """What makes the data learnable: the action is the clipped velocity toward the target (plus
    small noise), the next state is the state moved by action / fps, and every episode ends there."""
    c = data_columns(root)
    state, action = c["observation.state"].reshape(EPISODES, FRAMES, 4), c["action"].reshape(EPISODES, FRAMES, 2)
    for e in range(EPISODES):
        s, a = state[e], action[e]
        assert np.all(s[:, 2:] == s[0, 2:]), "the target moves"
        np.testing.assert_allclose(s[1:, :2], np.clip(s[:-1, :2] + a[:-1] / FPS, -1, 1), atol=1e-5)
        offset = s[:, 2:] - s[:, :2]
        velocity = demo.GAIN * offset
        norm = np.linalg.norm(velocity, axis=1, keepdims=True)
        velocity = np.where(norm > demo.MAX_SPEED, velocity * demo.MAX_SPEED / np.maximum(norm, 1e-12), velocity)
        assert np.abs(a - velocity).max() < 5 * demo.ACTION_NOISE
        assert np.linalg.norm(offset[0]) >= 0.8 and np.linalg.norm(offset[-1]) < 0.05
    assert np.std(action) > 0.1  # the actions vary: not a constant to learn
    assert np.all(c["task_index"].reshape(EPISODES, FRAMES) == (np.arange(EPISODES) % 2)[:, None])


def test_other_sizes_and_rates(tmp_path):
    size, fps = 48, 15
    ds = LeRobotDataset(write_demo_dataset(tmp_path / "dataset", episodes=3, frames=12, fps=fps, image_size=size, seed=5))
    assert (ds.fps, ds.num_frames, ds.features[TOP]["shape"]) == (fps, 36, [size, size, 3])
    assert ds.episode(2).videos[WRIST].from_timestamp == pytest.approx(24 / fps)
    for i in (0, 11, 12, 23, 24, 35):
        item = ds[i]
        assert item[TOP].shape == item[WRIST].shape == (size, size, 3)
        x, y = item["observation.state"][:2]
        np.testing.assert_allclose(centroid(item[TOP], 1), pixel(x, y, 1.0, size), atol=PIXEL_TOLERANCE, err_msg=f"frame {i}")
        np.testing.assert_allclose(centroid(item[WRIST], 1), [(size - 1) / 2] * 2, atol=PIXEL_TOLERANCE)


def test_deterministic_from_seed(tmp_path):
    a = write_demo_dataset(tmp_path / "a", **SMALL, seed=3)
    b = write_demo_dataset(tmp_path / "b", **SMALL, seed=3)
    longer = write_demo_dataset(tmp_path / "c", episodes=3, frames=10, seed=3)
    other = write_demo_dataset(tmp_path / "d", **SMALL, seed=4)
    da, db, dc, dd = (data_columns(p) for p in (a, b, longer, other))
    for name in da:
        np.testing.assert_array_equal(da[name], db[name])
        np.testing.assert_array_equal(da[name], dc[name][: len(da[name])], err_msg="episode e depends on the episode count")
    files = sorted(str(f.relative_to(a)) for f in a.rglob("*") if f.is_file())
    assert files == sorted(str(f.relative_to(b)) for f in b.rglob("*") if f.is_file())
    for name in files:  # byte for byte, all but the H.264 files (the encoder does not promise the same bytes)
        if not name.endswith(".mp4"):
            assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert not np.allclose(da["observation.state"], dd["observation.state"])
    ds_a, ds_b = LeRobotDataset(a), LeRobotDataset(b)
    for i in (0, 7, 13, 19):
        for key in (TOP, WRIST):
            # the same pictures, to within the encoder's rounding: x264 gave two writes of one seed
            # frames differing by 1.02 levels on average (max 19) on the CI machine
            fa, fb = ds_a[i][key], ds_b[i][key]
            diff = np.abs(fa.astype(np.int16) - fb.astype(np.int16))
            assert diff.mean() < 3.0 and diff.max() <= 64, (i, key, diff.mean(), diff.max())
            for channel in range(3):
                np.testing.assert_allclose(centroid(fa, channel), centroid(fb, channel), atol=PIXEL_TOLERANCE, err_msg=f"{i} {key}")


# ---- where it is written ------------------------------------------------------------------------


def test_a_second_call_returns_it_untouched(root):
    before = snapshot(root)
    assert write_demo_dataset(root) == root
    assert write_demo_dataset(str(root)) == root
    assert snapshot(root) == before
    assert sorted(p.name for p in root.parent.iterdir()) == ["dataset"]  # no temporaries either


def test_other_parameters_or_a_broken_copy_are_refused(root, tmp_path):
    before = snapshot(root)
    with pytest.raises(UserError, match="written with") as err:
        write_demo_dataset(root, seed=1)
    assert str(root) in str(err.value)
    assert snapshot(root) == before

    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    (copy / f"videos/{WRIST}/chunk-000/file-000.mp4").unlink()
    with pytest.raises(UserError, match=r"incomplete \(videos/observation\.images\.wrist/chunk-000/file-000\.mp4 is missing\)"):
        write_demo_dataset(copy)

    info = json.loads((copy / "meta/info.json").read_text())
    del info["loongforge_demo"]  # a LeRobot dataset, but not one this wrote
    (copy / "meta/info.json").write_text(json.dumps(info))
    with pytest.raises(UserError, match="is not a LoongForge demo dataset"):
        write_demo_dataset(copy)
    assert "loongforge_demo" not in json.loads((copy / "meta/info.json").read_text())


def test_an_unrelated_path_is_refused_and_left_intact(tmp_path):
    user = tmp_path / "user_data"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    before = snapshot(user)
    with pytest.raises(UserError, match="is not a LoongForge demo dataset") as err:
        write_demo_dataset(user, **SMALL)
    assert str(user) in str(err.value) and "\n" not in str(err.value)
    assert snapshot(user) == before and (user / "notes.txt").read_text() == "mine"

    a_file = tmp_path / "a_file"
    a_file.write_text("mine too")
    with pytest.raises(UserError, match=f"{a_file} exists and is not a directory"):
        write_demo_dataset(a_file, **SMALL)
    assert a_file.read_text() == "mine too"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "user_data"]

    empty = tmp_path / "empty"  # an empty directory holds nothing to lose: it is written
    empty.mkdir()
    assert LeRobotDataset(write_demo_dataset(empty, **SMALL)).num_frames == 20


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_crash_mid_write_leaves_no_dataset(tmp_path, monkeypatch, error):
    calls = []
    real_encode = demo._encode

    def crash_in_the_second_video(*args, **kwargs):
        calls.append(1)
        if len(calls) > SMALL["episodes"]:  # after the data file and the first camera's video
            raise error("simulated crash")
        return real_encode(*args, **kwargs)

    monkeypatch.setattr(demo, "_encode", crash_in_the_second_video)
    root = tmp_path / "dataset"
    with pytest.raises(error, match="simulated crash"):
        write_demo_dataset(root, **SMALL)
    assert len(calls) == SMALL["episodes"] + 1
    assert not os.path.lexists(root) and list(tmp_path.iterdir()) == []  # neither the dataset nor its temporary
    monkeypatch.setattr(demo, "_encode", real_encode)
    assert LeRobotDataset(write_demo_dataset(root, **SMALL)).num_episodes == 2


def test_a_concurrent_writer_that_finishes_first_wins(tmp_path, monkeypatch):
    """Two processes (ranks) writing the same dataset: the one whose rename comes second finds the
    other's complete copy in place, returns it and removes its own temporary."""
    root = tmp_path / "dataset"
    real_rename = os.rename
    renames = []

    def other_writer_first(src, dst):
        renames.append((Path(src).name, Path(dst)))
        if len(renames) == 1:
            monkeypatch.setattr(os, "rename", real_rename)
            write_demo_dataset(root, **SMALL)  # the other writer, complete before our rename
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", other_writer_first)
    assert write_demo_dataset(root, **SMALL) == root
    assert renames[0][0].startswith(".dataset.tmp-") and renames[0][1] == root
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dataset"]
    theirs = snapshot(root)
    assert write_demo_dataset(root, **SMALL) == root and snapshot(root) == theirs


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"image_size": 33}, "image_size must be even"),
        ({"image_size": 8}, "image_size must be at least 16"),
        ({"frames": 1}, "frames must be at least 2"),
        ({"episodes": 0}, "episodes must be at least 1"),
        ({"seed": -1}, "seed must be at least 0"),
        ({"fps": 2.5}, "fps must be an int"),
    ],
)
def test_bad_parameters(tmp_path, bad, message):
    with pytest.raises(UserError, match=message):
        write_demo_dataset(tmp_path / "dataset", **bad)
    assert list(tmp_path.iterdir()) == []
