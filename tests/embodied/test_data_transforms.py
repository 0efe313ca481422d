"""Normalization, computed stats, image transforms and dataset mixtures, on small inputs this module
makes itself: arrays, images and LeRobot datasets without cameras (v2.1 and v3.0 layouts, written
as the LeRobot reader's own tests write them, with no video)."""

from __future__ import annotations

import colorsys
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from loongforge.core.errors import UserError
from loongforge.embodied.data import (
    DatasetMixture,
    ImageAugment,
    ImageAugmenter,
    LeRobotDataset,
    Normalizer,
    NormMode,
    adjust_brightness,
    adjust_contrast,
    adjust_hue,
    adjust_saturation,
    adjust_sharpness,
    check_compatible,
    compute_stats,
    crop_resize,
    image_transforms,
    resize_with_pad,
    rotate,
)

FPS = 10


# ---- small LeRobot datasets (no cameras) -----------------------------------------------------------


def episode_values(seed: int, lengths: list[int], state_dim: int, action_dim: int) -> dict[str, np.ndarray]:
    """Every frame's values, in global frame order."""
    rng = np.random.default_rng(seed)
    n = sum(lengths)
    return {
        "observation.state": rng.normal(size=(n, state_dim)).astype(np.float32),
        "action": (rng.normal(size=(n, action_dim)) * 3 + 1).astype(np.float32),
        "observation.gripper": rng.uniform(0, 1, size=n).astype(np.float32),
    }


def write_dataset(root: Path, version: str, lengths: list[int], seed: int = 0, state_dim: int = 3, action_dim: int = 2) -> dict:
    """A LeRobot dataset at `root` (v2.1: one parquet per episode; v3.0: the first two episodes in
    one file, the rest in another) whose meta/stats hold mean/std/min/max/count but no quantiles;
    returns its values by feature."""
    values = episode_values(seed, lengths, state_dim, action_dim)
    starts = np.cumsum([0] + lengths[:-1]).tolist()
    scalar = {"shape": [1], "names": None}
    features = {
        "observation.state": {"dtype": "float32", "shape": [state_dim], "names": None},
        "action": {"dtype": "float32", "shape": [action_dim], "names": None},
        "observation.gripper": {"dtype": "float32", **scalar},
        "timestamp": {"dtype": "float32", **scalar},
        "frame_index": {"dtype": "int64", **scalar},
        "episode_index": {"dtype": "int64", **scalar},
        "index": {"dtype": "int64", **scalar},
        "task_index": {"dtype": "int64", **scalar},
    }
    schema = pa.schema(
        [
            ("observation.state", pa.list_(pa.float32(), state_dim)),
            ("action", pa.list_(pa.float32())),
            ("observation.gripper", pa.float32()),
            ("timestamp", pa.float32()),
            ("frame_index", pa.int64()),
            ("episode_index", pa.int64()),
            ("index", pa.int64()),
            ("task_index", pa.int64()),
        ]
    )

    def table(episodes: list[int]) -> pa.Table:
        rows = [k for e in episodes for k in range(starts[e], starts[e] + lengths[e])]
        cols = {key: values[key][rows].tolist() for key in ("observation.state", "action", "observation.gripper")}
        cols["frame_index"] = [k - starts[e] for e in episodes for k in range(starts[e], starts[e] + lengths[e])]
        cols["timestamp"] = [f / FPS for f in cols["frame_index"]]
        cols["episode_index"] = [e for e in episodes for _ in range(lengths[e])]
        cols["index"] = rows
        cols["task_index"] = [0] * len(rows)
        return pa.table(cols, schema=schema)

    stats = {
        key: {"mean": v.mean(0), "std": v.std(0), "min": v.min(0), "max": v.max(0), "count": [len(v)]}
        for key, v in values.items()
        if v.ndim == 2
    }
    stats = {f: {k: np.asarray(v).tolist() for k, v in d.items()} for f, d in stats.items()}
    info = {"codebase_version": version, "fps": FPS, "total_episodes": len(lengths), "total_frames": sum(lengths), "features": features}
    (root / "meta").mkdir(parents=True)
    if version == "v2.1":
        info |= {
            "chunks_size": 1000,
            "data_path": "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet",
            "video_path": "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4",
        }
        (root / "meta/tasks.jsonl").write_text(json.dumps({"task_index": 0, "task": "pick"}) + "\n")
        (root / "meta/episodes.jsonl").write_text(
            "".join(json.dumps({"episode_index": e, "tasks": ["pick"], "length": n}) + "\n" for e, n in enumerate(lengths))
        )
        (root / "meta/stats.json").write_text(json.dumps(stats))
        for e in range(len(lengths)):
            path = root / f"data/chunk-000/episode_{e:06d}.parquet"
            path.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(table([e]), path)
    else:
        info |= {
            "chunks_size": 1000,
            "data_path": "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet",
            "video_path": "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4",
        }
        pq.write_table(pa.table({"task_index": [0], "task": ["pick"]}), root / "meta/tasks.parquet")
        files = [list(range(min(2, len(lengths)))), list(range(2, len(lengths)))]
        rows = []
        for file_index, eps in enumerate(f for f in files if f):
            path = root / f"data/chunk-000/file-{file_index:03d}.parquet"
            path.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(table(eps), path)
            for e in eps:
                rows.append(
                    {
                        "episode_index": e,
                        "tasks": ["pick"],
                        "length": lengths[e],
                        "data/chunk_index": 0,
                        "data/file_index": file_index,
                        "dataset_from_index": starts[e],
                        "dataset_to_index": starts[e] + lengths[e],
                    }
                )
        (root / "meta/episodes/chunk-000").mkdir(parents=True)
        pq.write_table(pa.Table.from_pylist(rows), root / "meta/episodes/chunk-000/file-000.parquet")
        (root / "meta/stats.json").write_text(json.dumps(stats))
    (root / "meta/info.json").write_text(json.dumps(info))
    return values


LENGTHS = [6, 9, 5]


@pytest.fixture(scope="module", params=["v2.1", "v3.0"])
def dataset(request, tmp_path_factory) -> tuple[LeRobotDataset, dict]:
    root = tmp_path_factory.mktemp(f"lerobot_{request.param}") / "dataset"
    values = write_dataset(root, request.param, LENGTHS, seed=1)
    return LeRobotDataset(root), values


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> list[LeRobotDataset]:
    """Three datasets of 7, 11 and 4 frames."""
    out = []
    for i, (version, lengths) in enumerate([("v3.0", [3, 4]), ("v2.1", [5, 6]), ("v3.0", [4])]):
        root = tmp_path_factory.mktemp(f"mix_{i}") / "dataset"
        write_dataset(root, version, lengths, seed=10 + i)
        out.append(LeRobotDataset(root))
    return out


# ---- normalization ---------------------------------------------------------------------------------


def random_stats(rng: np.random.Generator, shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    low = rng.normal(size=shape)
    q = np.sort(rng.uniform(0.5, 3, size=(5, *shape)), axis=0)
    s = {"mean": rng.normal(size=shape), "std": rng.uniform(0.1, 2, size=shape), "min": low, "max": low + q[4]}
    s |= {"q01": low + q[0], "q10": low + q[1], "q50": low + q[2], "q90": low + q[3], "q99": low + q[4] - 0.1}
    return s


def test_each_mode_is_its_formula_and_unnormalize_inverts_it():
    rng = np.random.default_rng(0)
    eps = 1e-8
    stats = random_stats(rng, (3,))
    stats["max"][1] = stats["min"][1]  # a constant dim: the range becomes eps
    stats["q99"][2] = stats["q01"][2]
    x = rng.normal(size=(4, 5, 3)) * 2
    x[0, 0] = stats["min"]
    ranges = {"MIN_MAX": ("min", "max"), "QUANTILES": ("q01", "q99"), "QUANTILE10": ("q10", "q90")}
    for mode in NormMode:
        batch = {"action": x, "other": x}
        out = Normalizer({"action": stats}, {"action": mode}).normalize(batch)
        assert out["other"] is x  # keys without a mode are untouched
        if mode is NormMode.IDENTITY:
            want = x
        elif mode is NormMode.MEAN_STD:
            want = (x - stats["mean"]) / (stats["std"] + eps)
        else:
            low, high = (stats[name] for name in ranges[mode.value])
            d = np.where(high - low == 0, eps, high - low)
            want = 2 * (x - low) / d - 1
        np.testing.assert_allclose(out["action"], want, rtol=1e-12, atol=0, err_msg=mode.value)
        back = Normalizer({"action": stats}, {"action": mode.value.lower()}).unnormalize(out)
        np.testing.assert_allclose(back["action"], x, rtol=1e-9, atol=1e-12, err_msg=mode.value)
    out = Normalizer({"action": stats}, {"action": "MIN_MAX"}).normalize({"action": x})["action"]
    assert out[0, 0, 1] == -1.0  # the minimum of a constant dim maps to -1
    assert abs(out[1, 0, 1] - (2 * (x[1, 0, 1] - stats["min"][1]) / eps - 1)) < 1e-6 * abs(out[1, 0, 1])


def test_numpy_and_torch_inputs_with_leading_dims_and_image_stats():
    rng = np.random.default_rng(1)
    stats = {"observation.state": random_stats(rng, (4,)), "observation.images.top": random_stats(rng, (3, 1, 1))}
    modes = {"observation.state": NormMode.QUANTILES, "observation.images.top": NormMode.MEAN_STD}
    norm = Normalizer(stats, modes)
    state = rng.normal(size=(2, 3, 4)).astype(np.float32)
    image = rng.uniform(size=(2, 3, 5, 6)).astype(np.float32)
    np_out = norm.normalize({"observation.state": state, "observation.images.top": image})
    t_out = norm.normalize({"observation.state": torch.from_numpy(state), "observation.images.top": torch.from_numpy(image)})
    for key in modes:
        assert np_out[key].dtype == np.float32 and t_out[key].dtype == torch.float32
        np.testing.assert_allclose(t_out[key].numpy(), np_out[key], rtol=1e-6, atol=1e-6)
    mean, std = stats["observation.images.top"]["mean"], stats["observation.images.top"]["std"]
    np.testing.assert_allclose(np_out["observation.images.top"], (image - mean) / (std + 1e-8), rtol=1e-5, atol=1e-5)
    # integer and bfloat16 inputs compute in float32 (as LeRobot's float32 stats promote them)
    assert norm.normalize({"observation.state": torch.ones(2, 4, dtype=torch.int64)})["observation.state"].dtype == torch.float32
    assert norm.normalize({"observation.state": torch.ones(4, dtype=torch.bfloat16)})["observation.state"].dtype == torch.float32
    with pytest.raises(UserError, match=r"'observation.state' has shape \[2, 5\], its stats have shape \[4\]"):
        norm.normalize({"observation.state": np.zeros((2, 5))})
    with pytest.raises(UserError, match="its stats have shape"):
        norm.normalize({"observation.images.top": np.zeros((3,))})  # would broadcast to (3, 1, 3)


def test_missing_stats_and_unknown_modes_are_one_line_errors():
    stats = {"action": {"mean": [0.0], "std": [1.0], "min": [0.0], "max": [1.0]}}
    with pytest.raises(UserError) as e:
        Normalizer(stats, {"action": NormMode.QUANTILES})
    assert str(e.value) == (
        "dataset stats for 'action' lack 'q01' (QUANTILES needs q01 and q99); compute them with compute_stats(dataset, ['action'])"
    )
    with pytest.raises(UserError, match=r"^dataset stats have no 'observation.state' \(MEAN_STD needs mean and std\)"):
        Normalizer(stats, {"observation.state": "MEAN_STD"})
    with pytest.raises(UserError, match=r"unknown normalization mode 'zscore' for 'action' \(choose from IDENTITY, MEAN_STD"):
        Normalizer(stats, {"action": "zscore"})
    with pytest.raises(UserError, match="disagree in shape"):
        Normalizer({"action": {"mean": [0.0, 1.0], "std": [1.0]}}, {"action": "MEAN_STD"})
    Normalizer({}, {"action": "IDENTITY"})  # IDENTITY needs no stats


def test_state_dict_round_trips_through_json():
    rng = np.random.default_rng(2)
    stats = {"a": random_stats(rng, (3,)), "b": random_stats(rng, (2, 1)), "c": random_stats(rng, (1,))}
    norm = Normalizer(stats, {"a": "QUANTILE10", "b": "MEAN_STD", "c": "IDENTITY"})
    state = json.loads(json.dumps(norm.state_dict()))
    assert state["features"]["a"]["stats"].keys() == {"q10", "q90"}  # only what the mode reads
    assert state["features"]["c"] == {"mode": "IDENTITY", "stats": {}}
    again = Normalizer.from_state_dict(state)
    batch = {"a": rng.normal(size=(5, 3)), "b": rng.normal(size=(4, 2, 7)), "c": rng.normal(size=(1,))}
    for key, value in norm.normalize(batch).items():
        assert np.array_equal(value, again.normalize(batch)[key])
    with pytest.raises(UserError, match="format"):
        Normalizer.from_state_dict({"features": {}})


def test_compute_stats_reads_every_frame(dataset):
    ds, values = dataset
    stats = compute_stats(ds, ["observation.state", "action", "observation.gripper"])
    for key, v in values.items():
        v = v.astype(np.float64).reshape(len(v), -1)
        got = stats[key]
        assert got["count"].tolist() == [sum(LENGTHS)]
        assert got["mean"].shape == (v.shape[1],)  # a scalar feature's stats are of shape (1,)
        np.testing.assert_allclose(got["mean"], v.mean(0), rtol=1e-12)
        np.testing.assert_allclose(got["std"], v.std(0), rtol=1e-12)
        np.testing.assert_array_equal(got["min"], v.min(0))
        np.testing.assert_array_equal(got["max"], v.max(0))
        for q in (1, 10, 50, 90, 99):
            np.testing.assert_allclose(got[f"q{q:02d}"], np.quantile(v, q / 100, axis=0), rtol=1e-12)
    assert set(compute_stats(ds)) == {"observation.state", "action", "observation.gripper", "timestamp", "frame_index"} | {
        "episode_index",
        "index",
        "task_index",
    }
    # the dataset's own stats lack quantiles; computed ones let QUANTILES work
    with pytest.raises(UserError, match="lack 'q01'"):
        Normalizer(ds.stats, {"action": "QUANTILES"})
    norm = Normalizer({**ds.stats, **compute_stats(ds, ["action"])}, {"action": "QUANTILES"})
    out = norm.normalize({"action": values["action"]})["action"]
    assert np.mean((out >= -1) & (out <= 1)) >= 0.9
    with pytest.raises(UserError, match="no feature 'observation.missing'"):
        compute_stats(ds, ["observation.missing"])


# ---- resize with pad --------------------------------------------------------------------------------


def test_resize_with_pad_hand_checked_cases():
    img = torch.arange(1, 25, dtype=torch.uint8).reshape(2, 4, 3)  # h=2, w=4, c=3 (channels last)
    out = resize_with_pad(img, 4, 4)
    assert out.shape == (4, 4, 3) and out.dtype == torch.uint8
    assert torch.equal(out[1:3], img) and not out[0].any() and not out[3].any()  # one pad row on top and bottom
    out = resize_with_pad(img, 5, 4)  # odd padding: the extra row goes to the bottom
    assert torch.equal(out[1:3], img) and not out[0].any() and not out[3:].any()

    chw = torch.linspace(-1, 1, 3 * 2 * 8).reshape(3, 2, 8)  # channels first (last dim > 4), float32
    out = resize_with_pad(chw, 4, 8)
    assert out.shape == (3, 4, 8)
    assert torch.equal(out[:, 1:3], chw) and (out[:, 0] == -1).all() and (out[:, 3] == -1).all()

    # 4x8 into 4x4: scale 2, resized to 2x4, each pixel the mean of a 2x2 block (bilinear, half-pixel centres)
    big = torch.tensor([[0.0, 0.2, 0.4, 0.6, -0.2, -0.4, 1.0, 1.0]] * 2 + [[0.2, 0.4, 0.6, 0.8, -0.4, -0.6, 1.0, 0.6]] * 2)
    out = resize_with_pad(big[None].expand(3, 4, 8), 4, 4)
    want = torch.tensor([[0.1, 0.5, -0.3, 1.0], [0.3, 0.7, -0.5, 0.8]])
    assert out.shape == (3, 4, 4)
    torch.testing.assert_close(out[:, 1:3], want.expand(3, 2, 4), rtol=0, atol=1e-6)
    assert (out[:, 0] == -1).all() and (out[:, 3] == -1).all()

    # 8x4 into 4x4 (height-bound): resized 4x2, one pad column left and right
    tall = torch.full((8, 4, 1), 200, dtype=torch.uint8)
    out = resize_with_pad(tall, 4, 4)
    assert out.shape == (4, 4, 1) and (out[:, 1:3] == 200).all() and not out[:, 0].any() and not out[:, 3].any()

    # upscaling 2x4 into 8x8: scale 1/2, resized 4x8, two pad rows top and bottom
    out = resize_with_pad(torch.full((2, 4, 3), 100, dtype=torch.uint8), 8, 8)
    assert out.shape == (8, 8, 3) and (out[2:6] == 100).all() and not out[:2].any() and not out[6:].any()

    # 3x7 into 5x5: scale 7/5, resized int(3 / 1.4) = 2 by int(7 / 1.4) = 5; pads 1 and 2 rows
    out = resize_with_pad(torch.full((3, 7, 3), 50, dtype=torch.uint8), 5, 5)
    assert (out[1:3] == 50).all() and not out[0].any() and not out[3:].any()


def test_resize_with_pad_layouts_dtypes_and_leading_dims():
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, 256, (2, 3, 6, 10, 3), dtype=torch.uint8, generator=g)
    out = resize_with_pad(batch, 8, 8)
    assert out.shape == (2, 3, 8, 8, 3)
    for i in range(2):
        for j in range(3):
            assert torch.equal(out[i, j], resize_with_pad(batch[i, j], 8, 8))
    assert resize_with_pad(batch[0, :1], 8, 8).shape == (1, 8, 8, 3)  # a batch of one keeps its dim
    chw = batch.permute(0, 1, 4, 2, 3).float() / 127.5 - 1  # [*b, c, h, w]
    out_chw = resize_with_pad(chw, 8, 8)
    assert out_chw.shape == (2, 3, 3, 8, 8)
    ref = F.interpolate(chw.reshape(6, 3, 6, 10), size=(4, 8), mode="bilinear", align_corners=False).clamp(-1, 1)
    torch.testing.assert_close(out_chw.reshape(6, 3, 8, 8)[:, :, 2:6], ref, rtol=0, atol=0)
    assert (out_chw[..., :2, :] == -1).all() and (out_chw[..., 6:, :] == -1).all()
    # float32 is clamped to [-1, 1] (its expected range)
    assert resize_with_pad(torch.full((2, 4, 3), 1.5), 4, 4)[1:3].eq(1.0).all()
    with pytest.raises(ValueError, match="unsupported image dtype torch.float64"):
        resize_with_pad(torch.zeros(2, 4, 3, dtype=torch.float64), 4, 4)


@pytest.mark.gpu
def test_resize_with_pad_on_cuda_matches_cpu():
    g = torch.Generator().manual_seed(0)
    img = torch.randint(0, 256, (2, 30, 40, 3), dtype=torch.uint8, generator=g)
    cpu, gpu = resize_with_pad(img, 24, 24), resize_with_pad(img.cuda(), 24, 24).cpu()
    assert gpu.dtype == torch.uint8 and (cpu.int() - gpu.int()).abs().max() <= 1  # float32 interpolation there
    f = img.float() / 127.5 - 1
    torch.testing.assert_close(resize_with_pad(f.cuda(), 24, 24).cpu(), resize_with_pad(f, 24, 24), rtol=0, atol=1e-5)


# ---- colour adjustments --------------------------------------------------------------------------


PIL_ENHANCE = {"brightness": "Brightness", "contrast": "Contrast", "saturation": "Color", "sharpness": "Sharpness"}
ADJUST = {"brightness": adjust_brightness, "contrast": adjust_contrast, "saturation": adjust_saturation, "sharpness": adjust_sharpness}


@pytest.mark.parametrize("name", list(PIL_ENHANCE))
def test_color_adjustments_match_pil_image_enhance(name):
    from PIL import Image, ImageEnhance

    rng = np.random.default_rng(3)
    img = rng.integers(0, 256, (13, 17, 3), dtype=np.uint8)
    img[:4, :4] = [250, 10, 128]  # a flat patch, beside the noise
    x = torch.from_numpy(img).permute(2, 0, 1).float() / 255
    for factor in (0.0, 0.5, 0.8, 1.2, 1.5):
        pil = np.asarray(getattr(ImageEnhance, PIL_ENHANCE[name])(Image.fromarray(img)).enhance(factor)).astype(np.int64)
        ours = (ADJUST[name](x, factor) * 255).round().permute(1, 2, 0).numpy().astype(np.int64)
        # +-1 per pixel: PIL works on uint8 and truncates its blend to an integer (at most 1 level
        # below the exact value), and its degenerate image (the L-mode gray, its mean for contrast,
        # the SMOOTH-filtered image) is itself rounded to integers (at most 0.5 off, scaled by
        # |1 - factor| <= 0.5 in the blend); ours is exact in float32 and rounded once here.
        assert np.abs(ours - pil).max() <= 1, (name, factor)
    assert torch.equal(ADJUST[name](x, 1.0), x)  # identity factor


def test_hue_matches_colorsys_and_known_pixels():
    rng = np.random.default_rng(4)
    img = rng.random((3, 6, 7)).astype(np.float32)
    img[:, 0, 0] = 0.5  # gray: no hue to rotate
    for factor in (-0.5, -0.2, 0.05, 0.5):
        ours = adjust_hue(torch.from_numpy(img), factor).numpy()
        want = np.empty_like(img)
        for i in range(img.shape[1]):
            for j in range(img.shape[2]):
                h, s, v = colorsys.rgb_to_hsv(*img[:, i, j].tolist())
                want[:, i, j] = colorsys.hsv_to_rgb((h + factor) % 1.0, s, v)
        np.testing.assert_allclose(ours, want, rtol=0, atol=1e-5, err_msg=str(factor))
    red = torch.tensor([1.0, 0.0, 0.0]).reshape(3, 1, 1)
    torch.testing.assert_close(adjust_hue(red, 1 / 3), torch.tensor([0.0, 1.0, 0.0]).reshape(3, 1, 1))  # red -> green
    torch.testing.assert_close(adjust_hue(red, -1 / 3), torch.tensor([0.0, 0.0, 1.0]).reshape(3, 1, 1))  # red -> blue
    with pytest.raises(ValueError, match=r"hue factor must be in \[-0.5, 0.5\]"):
        adjust_hue(red, 0.6)


def test_identity_parameters_give_the_input_back_exactly():
    x = torch.rand(2, 3, 9, 12, generator=torch.Generator().manual_seed(5))
    for out in (
        adjust_brightness(x, 1.0),
        adjust_contrast(x, 1.0),
        adjust_saturation(x, 1.0),
        adjust_sharpness(x, 1.0),
        adjust_hue(x, 0.0),
        rotate(x, 0.0),
        crop_resize(x, 0, 0, 9, 12),
    ):
        assert torch.equal(out, x)
    ones = dict(brightness=(1, 1), contrast=(1, 1), saturation=(1, 1), hue=(0, 0), sharpness=(1, 1))
    cfg = ImageAugment(**ones, max_num_transforms=5, crop_scale=1.0, rotate_degrees=0.0)
    out = ImageAugmenter(cfg)({"observation.images.top": x}, torch.Generator().manual_seed(0))
    assert torch.equal(out["observation.images.top"], x)


def test_rotate_and_crop_resize_geometry():
    g = torch.Generator().manual_seed(6)
    square = torch.rand(2, 3, 8, 8, generator=g)
    torch.testing.assert_close(rotate(square, 90), torch.rot90(square, 1, (-2, -1)), rtol=0, atol=1e-6)  # counter-clockwise
    wide = torch.rand(3, 6, 10, generator=g)
    torch.testing.assert_close(rotate(wide, 180), wide.flip(-1).flip(-2), rtol=0, atol=1e-6)  # pixel space, any aspect
    small = rotate(torch.ones(1, 21, 21), 5)
    assert small[0, 10, 10] == 1 and small[0, 0, 0] < 1  # the centre stays, corners pull in zeros
    img = torch.arange(16.0).reshape(1, 4, 4) / 16
    assert torch.equal(crop_resize(img, 1, 2, 1, 1), torch.full((1, 4, 4), img[0, 1, 2].item()))  # one pixel blown up
    out = crop_resize(img, 0, 0, 2, 2)
    torch.testing.assert_close(out, F.interpolate(img[None, :, :2, :2], size=(4, 4), mode="bilinear", align_corners=False)[0])
    with pytest.raises(ValueError, match="does not fit"):
        crop_resize(img, 3, 0, 2, 2)


# ---- the configured augmentation --------------------------------------------------------------------


def camera_images(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"observation.images.top": torch.rand(3, 20, 24, generator=g), "observation.images.wrist": torch.rand(2, 3, 20, 24, generator=g)}


def test_augmenter_is_reproducible_per_generator_seed():
    aug = ImageAugmenter(ImageAugment())
    images = camera_images(7)
    a = aug(images, torch.Generator().manual_seed(1))
    b = aug(images, torch.Generator().manual_seed(1))
    c = aug(images, torch.Generator().manual_seed(2))
    for key in images:
        assert torch.equal(a[key], b[key])
        assert not torch.equal(a[key], c[key])
        assert not torch.equal(a[key], images[key])
        assert a[key].shape == images[key].shape and a[key].min() >= 0 and a[key].max() <= 1


def test_augmenter_geometry_skips_wrist_cameras_and_caps_the_transforms(monkeypatch):
    images = camera_images(8)
    geometry_only = ImageAugment(brightness=None, contrast=None, saturation=None, hue=None, sharpness=None)
    out = ImageAugmenter(geometry_only)(images, torch.Generator().manual_seed(0))
    assert torch.equal(out["observation.images.wrist"], images["observation.images.wrist"])
    assert not torch.equal(out["observation.images.top"], images["observation.images.top"])

    calls = []
    for name, fn in list(image_transforms._ADJUST.items()):
        monkeypatch.setitem(image_transforms._ADJUST, name, lambda img, f, name=name, fn=fn: calls.append(name) or fn(img, f))
    cfg = ImageAugment(max_num_transforms=2, crop_scale=None, rotate_degrees=None, cameras=("observation.images.top",))
    seen = set()
    for seed in range(12):
        calls.clear()
        out = ImageAugmenter(cfg)(images, torch.Generator().manual_seed(seed))
        assert len(calls) == 2 and calls == sorted(calls, key=image_transforms.COLOR_TRANSFORMS.index)
        seen.update(calls)
        assert out["observation.images.wrist"] is images["observation.images.wrist"]  # not in `cameras`
    assert seen == set(image_transforms.COLOR_TRANSFORMS)  # the subset is drawn, not fixed


def test_augment_config_errors():
    with pytest.raises(UserError, match=r"hue range \[-0.7, 0.1\] must lie within \[-0.5, 0.5\]"):
        ImageAugment(hue=(-0.7, 0.1))
    with pytest.raises(UserError, match="brightness range .* must not be negative"):
        ImageAugment(brightness=[-0.1, 1.0])
    with pytest.raises(UserError, match="contrast range .* low <= high"):
        ImageAugment(contrast=(1.2, 0.8))
    with pytest.raises(UserError, match="crop_scale"):
        ImageAugment(crop_scale=1.5)
    with pytest.raises(UserError, match=r"cameras \['observation.images.side'\] are not among the images"):
        ImageAugmenter(ImageAugment(cameras=["observation.images.side"]))(camera_images(0), torch.Generator())
    assert ImageAugment(saturation=[0.5, 1.5]).saturation == (0.5, 1.5)  # YAML lists become tuples


# ---- dataset mixtures ---------------------------------------------------------------------------


def test_mixture_draws_by_weight(mixed):
    weights = [0.5, 0.3, 0.2]
    mix = DatasetMixture(mixed, [w * 7 for w in weights], seed=3)  # only the ratios matter
    draws = mix.indices(0, 20_000)
    ids = np.array([d for d, _ in draws])
    share = np.bincount(ids, minlength=3) / len(ids)
    assert np.abs(share - weights).max() < 0.02, share
    assert all(0 <= f < len(mixed[d]) for d, f in draws)
    assert len({tuple(ids[i : i + 10]) for i in range(0, 2000, 10)}) > 150  # interleaved, not in runs


def test_mixture_visits_each_dataset_as_a_fresh_permutation_per_pass(mixed):
    mix = DatasetMixture(mixed, [1, 1, 1], seed=4)
    frames = {d: [] for d in range(3)}
    for d, f in mix.indices(0, 600):
        frames[d].append(f)
    for d, seq in frames.items():
        n = len(mixed[d])
        passes = [seq[i : i + n] for i in range(0, len(seq) - n + 1, n)]
        assert len(passes) >= 3
        for p in passes:
            assert sorted(p) == list(range(n))
        assert len({tuple(p) for p in passes}) > 1  # a new order each pass


def test_mixture_stream_depends_only_on_seed_and_position(mixed):
    mix = DatasetMixture(mixed, [0.6, 0.3, 0.1], seed=5, round_size=64)
    full = mix.indices(0, 3000)
    resumed = DatasetMixture(mixed, [0.6, 0.3, 0.1], seed=5, round_size=64)
    assert resumed.indices(1234, 3000) == full[1234:]
    assert [resumed.index(p) for p in (2999, 17, 640, 17)] == [full[2999], full[17], full[640], full[17]]  # any order
    ids = [d for d, _ in full]
    rounds = {tuple(ids[mix.round_start(r) : mix.round_start(r + 1)]) for r in range(40)}
    assert len(rounds) > 30  # each round has its own order
    other = DatasetMixture(mixed, [0.6, 0.3, 0.1], seed=6, round_size=64).indices(0, 3000)
    assert other != full and sum(a == b for a, b in zip(other, full)) < 2000
    d, f = mix.index(77)
    np.testing.assert_array_equal(mix[77]["action"], mixed[d][f]["action"])


def test_mixture_rejects_bad_weights_and_incompatible_datasets(mixed, tmp_path):
    for weights in ([1, 0, 1], [1, -2, 1], [1, float("nan"), 1], [1, float("inf"), 1]):
        with pytest.raises(UserError, match=r"^mixture weights must be positive and finite, got .*dataset") as e:
            DatasetMixture(mixed, weights)
        assert "\n" not in str(e.value) and str(mixed[1].root) in str(e.value)
    with pytest.raises(UserError, match="2 weights for 3 datasets"):
        DatasetMixture(mixed, [1, 1])

    write_dataset(tmp_path / "wide", "v3.0", [4], action_dim=3)
    wide = LeRobotDataset(tmp_path / "wide")
    with pytest.raises(UserError) as e:
        check_compatible([*mixed, wide], ["observation.state", "action"])
    assert str(e.value).startswith(f"{wide.root}: feature 'action' has shape [3], {mixed[0].root} has [2]")
    with pytest.raises(UserError) as e:
        check_compatible(mixed, ["action", "observation.images.top"])
    assert str(e.value).startswith(f"{mixed[0].root}: no feature 'observation.images.top', which the policy reads")
    check_compatible(mixed, ["observation.state", "action", "observation.gripper"])
