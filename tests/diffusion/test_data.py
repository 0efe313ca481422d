"""loongforge.diffusion.data: the demo videos show what their captions say, media reads and
resizes as documented, buckets, the frozen encoders agree with diffusers' Wan pipeline, and
preprocessing counts bad samples, resumes to the same output and refuses other directories.

Where a shape lies in a demo frame is computed here from the demo module's docstring formula (not
from the module's code), and found in the decoded frame as the centroid of the pixels nearer its
colour than the background.
"""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from loongforge.core.errors import UserError
from loongforge.diffusion.data import (
    BadMedia,
    Bucket,
    LatentDataset,
    choose_bucket,
    decode_frames,
    decode_latents,
    encode_text,
    encode_video,
    load_text_encoder,
    load_vae,
    parse_buckets,
    preprocess,
    read_image,
    read_video,
    resize_crop,
    save_frozen,
    vae_latent_stats,
    write_demo_videos,
)

prep_mod = importlib.import_module("loongforge.diffusion.data.preprocess")  # the package's `preprocess` is the function

COLOURS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (40, 70, 230), "yellow": (230, 210, 40)}
BACKGROUND = (24, 24, 28)
PIXEL_TOLERANCE = 1.0
FRAMES, SIZE, FPS = 9, 32, 8
BUCKETS = ["32x32x9", "32x32x1", "16x32x1"]


def expected_centre(direction: str, n: int, frames: int, h: int, w: int) -> tuple[float, float]:
    """(column, row), the demo docstring's formula."""
    m = max(4, min(h, w) // 4) / 2
    p = n / (frames - 1)
    return {
        "right": (m + p * (w - 1 - 2 * m), (h - 1) / 2),
        "left": (w - 1 - m - p * (w - 1 - 2 * m), (h - 1) / 2),
        "down": ((w - 1) / 2, m + p * (h - 1 - 2 * m)),
        "up": ((w - 1) / 2, h - 1 - m - p * (h - 1 - 2 * m)),
    }[direction]


def centroid(frame: np.ndarray, colour) -> tuple[float, float]:
    img = frame.astype(np.float64)
    near = np.linalg.norm(img - np.array(colour), axis=-1) < np.linalg.norm(img - np.array(BACKGROUND), axis=-1)
    rows, cols = np.nonzero(near)
    assert len(rows) > 4, "shape not found"
    return cols.mean(), rows.mean()


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("demo") / "videos"
    assert write_demo_videos(root) == root
    return root


@pytest.fixture(scope="module")
def encoders():
    vae = load_vae("tiny")
    tokenizer, encoder = load_text_encoder("tiny")
    return vae, tokenizer, encoder


# ---- demo videos ---------------------------------------------------------------------------------


def test_demo_videos_show_their_captions(demo, tmp_path):
    lines = [json.loads(line) for line in (demo / "captions.jsonl").read_text().splitlines()]
    assert len(lines) == 24 and [set(x) for x in lines] == [{"video", "caption"}] * 24
    assert lines[0]["video"] == "videos/00000.mp4"
    seen = set()
    for x in lines:
        _, colour, shape, _, direction = x["caption"].split()
        seen.add((colour, shape, direction))
        assert shape in ("square", "circle")
        frames = read_video(demo / x["video"], FRAMES, None)
        assert frames.shape == (FRAMES, SIZE, SIZE, 3) and frames.dtype == np.uint8
        for n in (0, FRAMES - 1):
            got = centroid(frames[n], COLOURS[colour])
            want = expected_centre(direction, n, FRAMES, SIZE, SIZE)
            assert abs(got[0] - want[0]) <= PIXEL_TOLERANCE and abs(got[1] - want[1]) <= PIXEL_TOLERANCE, (x, n, got, want)
    assert len(seen) == 24  # 24 distinct combinations of the 32
    # deterministic, an existing set is returned as it is, another is refused
    again = write_demo_videos(tmp_path / "again")
    assert (again / "captions.jsonl").read_bytes() == (demo / "captions.jsonl").read_bytes()
    assert write_demo_videos(again) == again
    with pytest.raises(UserError, match="written with"):
        write_demo_videos(again, seed=1)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("x")
    with pytest.raises(UserError, match="not a LoongForge demo"):
        write_demo_videos(tmp_path / "other")


# ---- media ---------------------------------------------------------------------------------------


def test_read_video_sampling_and_errors(demo, tmp_path):
    path = demo / "videos/00003.mp4"
    every = read_video(path, FRAMES, None)
    assert np.array_equal(read_video(path, 5, FPS / 2), every[::2])  # 4 fps of an 8 fps video
    assert np.array_equal(read_video(path, 3, None), every[:3])
    assert len(decode_frames(path, None, FPS)) == FRAMES
    with pytest.raises(BadMedia) as e:
        read_video(path, 6, FPS / 2)  # 5 frames at 4 fps
    assert e.value.reason == "too_short" and str(path) in str(e.value)
    with pytest.raises(BadMedia) as e:
        read_video(tmp_path / "nope.mp4", 1, None)
    assert e.value.reason == "missing"
    junk = tmp_path / "junk.mp4"
    junk.write_bytes(np.random.default_rng(0).integers(0, 256, 4000, dtype=np.uint8).tobytes())
    with pytest.raises(BadMedia) as e:
        read_video(junk, 1, None)
    assert e.value.reason == "corrupt"
    with pytest.raises(BadMedia) as e:
        read_image(junk)
    assert e.value.reason == "corrupt"


def test_uniform_frames_whole_video(demo, tmp_path):
    """A fixed count spread over the whole video equals decoding every frame and indexing, whether
    the container records the frame count (mp4) or it comes from the packets (matroska)."""
    import av
    from loongforge.core.data.media import uniform_frames, uniform_indices

    path = demo / "videos/00003.mp4"
    every = read_video(path, FRAMES, None)
    mkv = tmp_path / "same.mkv"
    with av.open(str(path)) as src, av.open(str(mkv), "w", format="matroska") as dst:
        out = dst.add_stream_from_template(src.streams.video[0])
        for packet in src.demux(src.streams.video[0]):
            if packet.dts is not None:
                packet.stream = out
                dst.mux(packet)
    with av.open(str(mkv)) as c:
        assert c.streams.video[0].frames == 0  # no count in the container: the packets are counted
    for source in (path, mkv, path.read_bytes()):
        for n in (1, 4, FRAMES, 2 * FRAMES):  # more than the video has: frames repeat
            assert np.array_equal(uniform_frames(source, n), every[uniform_indices(FRAMES, n)]), (source, n)
    assert uniform_indices(9, 4).tolist() == [0, 2, 4, 6]
    with pytest.raises(BadMedia) as e:
        uniform_frames(tmp_path / "nope.mp4", 2)
    assert e.value.reason == "missing"
    junk = tmp_path / "junk.mp4"
    junk.write_bytes(np.random.default_rng(0).integers(0, 256, 4000, dtype=np.uint8).tobytes())
    with pytest.raises(BadMedia) as e:
        uniform_frames(junk, 2)
    assert e.value.reason == "corrupt"


def test_read_image(tmp_path):
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 256, (12, 20, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "a.png")
    Image.fromarray(pixels[..., 0]).save(tmp_path / "gray.png")
    got = read_image(tmp_path / "a.png")
    assert got.shape == (1, 12, 20, 3) and got.dtype == np.uint8 and np.array_equal(got[0], pixels)
    assert np.array_equal(read_image(tmp_path / "gray.png")[0], np.repeat(pixels[..., :1], 3, axis=-1))
    with pytest.raises(BadMedia) as e:
        read_image(tmp_path / "missing.png")
    assert e.value.reason == "missing"


def test_resize_crop():
    frames = np.zeros((5, 32, 64, 3), np.uint8)
    frames[:, :, :16] = 255  # left quarter: cropped away at scale 1
    frames[:, :, 16:48] = np.arange(32, dtype=np.uint8)[None, None, :, None] * 8
    out = resize_crop(frames, 32, 32)
    assert out.shape == (3, 5, 32, 32) and out.dtype == torch.float32
    want = torch.from_numpy(frames[:, :, 16:48]).permute(3, 0, 1, 2).float() / 127.5 - 1
    assert torch.equal(out, want)
    # downscale to cover, then crop the longer side; a constant picture stays constant
    out = resize_crop(np.full((2, 48, 80, 3), 255, np.uint8), 16, 32)
    assert out.shape == (3, 2, 16, 32) and torch.allclose(out, torch.ones_like(out))
    out = resize_crop(np.random.default_rng(0).integers(0, 256, (1, 40, 24, 3), dtype=np.uint8), 32, 32)
    assert out.shape == (3, 1, 32, 32) and out.min() >= -1 and out.max() <= 1


# ---- buckets -------------------------------------------------------------------------------------


def test_buckets():
    b = parse_buckets(["480x832x81", "832x480x81", "480x480x33", "480x832x1", " 240 x 416 x 81 "])
    assert b[0] == Bucket(480, 832, 81) and b[4] == Bucket(240, 416, 81)
    assert choose_bucket(720, 1280, 120, b) == Bucket(480, 832, 81)  # same ratio: the larger area
    assert choose_bucket(1280, 720, 81, b) == Bucket(832, 480, 81)
    assert choose_bucket(500, 500, 40, b) == Bucket(480, 480, 33)
    assert choose_bucket(720, 1280, 40, b) == Bucket(480, 832, 1)  # the 81-frame ones are too long
    videos = [x for x in b if x.frames > 1]  # preprocess gives a video only these
    assert choose_bucket(720, 1280, 40, videos) == Bucket(480, 480, 33)
    assert choose_bucket(720, 1280, 1, b) == Bucket(480, 832, 1)
    assert choose_bucket(720, 1280, 20, parse_buckets(["480x832x81"])) is None
    # equal aspect ratio: the most frames first, then the area
    assert choose_bucket(32, 32, 9, parse_buckets(["32x32x5", "64x64x5", "16x16x9"])) == Bucket(16, 16, 9)
    for bad, words in (
        ("480x830x81", "divisible by 16"),
        ("480x832x80", "4k\\+1"),
        ("480x832", "HEIGHTxWIDTHxFRAMES"),
        ("0x16x1", "positive"),
    ):
        with pytest.raises(UserError, match=f"{bad!r}.*{words}"):
            parse_buckets(["32x32x9", bad])
    with pytest.raises(UserError, match="twice"):
        parse_buckets(["32x32x9", "32x32x9"])


# ---- encoders ------------------------------------------------------------------------------------


def test_encode_text_matches_wan_pipeline(encoders):
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    vae, tokenizer, encoder = encoders
    captions = ["a red square moving right", "  a blue &amp; yellow\n circle   moving up ", "x"]
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=encoder, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler())
    for max_length in (512, 8):
        ours = encode_text(tokenizer, encoder, captions, max_length)
        ref = pipe._get_t5_prompt_embeds(captions, max_sequence_length=max_length, device=torch.device("cpu"))
        for o, r in zip(ours, ref):
            assert o.shape[1] == 32 and 0 < o.shape[0] <= max_length
            assert torch.equal(o, r[: len(o)]) and not r[len(o) :].any()
    assert [len(t) for t in encode_text(tokenizer, encoder, captions, 8)][0] == 8  # truncated
    # a caption's embedding does not depend on its batch
    assert torch.equal(encode_text(tokenizer, encoder, captions[1:2])[0], encode_text(tokenizer, encoder, captions)[1])
    # seed-0 weights: another load gives the same encoder
    _, again = load_text_encoder("tiny")
    assert all(torch.equal(a, b) for a, b in zip(encoder.state_dict().values(), again.state_dict().values()))
    assert not any(p.requires_grad for p in encoder.parameters()) and not encoder.training


def test_encode_decode_video(encoders, tmp_path):
    vae, _, _ = encoders
    assert vae.config.z_dim == 4 and not vae.training and not any(p.requires_grad for p in vae.parameters())
    again = load_vae("tiny")
    assert all(torch.equal(a, b) for a, b in zip(vae.state_dict().values(), again.state_dict().values()))
    # a VAE directory whose config has non-trivial latent stats
    vae.save_pretrained(str(tmp_path / "pipe" / "vae"))
    cfg_path = tmp_path / "pipe" / "vae" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    mean, std = [0.5, -0.25, 1.0, 0.0], [2.0, 0.5, 1.5, 3.0]
    cfg.update(latents_mean=mean, latents_std=std)
    cfg_path.write_text(json.dumps(cfg))
    loaded = load_vae(str(tmp_path / "pipe"))
    assert [t.tolist() for t in vae_latent_stats(loaded)] == [mean, std]
    video = torch.rand(3, FRAMES, SIZE, SIZE, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = encode_video(loaded, video)
    assert latents.shape == (4, 3, 4, 4)
    with torch.no_grad():
        z = loaded.encode(video[None]).latent_dist.mean[0]
    m, s = torch.tensor(mean).view(4, 1, 1, 1), torch.tensor(std).view(4, 1, 1, 1)
    torch.testing.assert_close(latents, (z - m) / s, rtol=1e-6, atol=1e-6)
    decoded = decode_latents(loaded, latents)
    assert decoded.shape == (3, FRAMES, SIZE, SIZE) and decoded.min() >= -1 and decoded.max() <= 1
    with torch.no_grad():
        direct = loaded.decode((latents * s + m)[None]).sample[0]
    torch.testing.assert_close(decoded, direct, rtol=1e-5, atol=1e-5)
    assert encode_video(vae, video[:, :1]).shape == (4, 1, 4, 4)  # an image: one latent frame


def test_save_frozen(encoders, tmp_path):
    vae, tokenizer, encoder = encoders
    paths = save_frozen("tiny", "tiny", tmp_path / "frozen")
    assert sorted(p.name for p in (tmp_path / "frozen").iterdir()) == ["text_encoder", "tokenizer", "vae"]
    vae2 = load_vae(paths["vae"])
    tok2, enc2 = load_text_encoder(paths["text_encoder"])
    assert all(torch.equal(a, b) for a, b in zip(vae.state_dict().values(), vae2.state_dict().values()))
    caps = ["a green circle moving left"]
    assert torch.equal(encode_text(tok2, enc2, caps)[0], encode_text(tokenizer, encoder, caps)[0])
    # directory specs are recorded, not copied
    assert save_frozen(paths["vae"], paths["text_encoder"], tmp_path / "unused") == paths
    assert not (tmp_path / "unused").exists()
    with pytest.raises(UserError, match="VAE not found"):
        load_vae(str(tmp_path / "nothing"))


# ---- preprocessing -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def source(demo, tmp_path_factory) -> Path:
    """6 demo videos, then a missing file, a corrupt one, an empty caption, a 3-frame video and a
    24 x 40 image."""
    from PIL import Image

    root = tmp_path_factory.mktemp("source")
    shutil.copytree(demo / "videos", root / "videos")
    lines = [json.loads(x) for x in (demo / "captions.jsonl").read_text().splitlines()][:6]
    (root / "videos" / "junk.mp4").write_bytes(np.random.default_rng(1).integers(0, 256, 3000, dtype=np.uint8).tobytes())
    short = write_demo_videos(tmp_path_factory.mktemp("short") / "v", count=1, frames=3)
    shutil.copy(short / "videos/00000.mp4", root / "videos" / "short.mp4")
    Image.fromarray(np.random.default_rng(2).integers(0, 256, (24, 40, 3), dtype=np.uint8)).save(root / "still.png")
    lines[2:2] = [{"video": "videos/missing.mp4", "caption": "a ghost"}, {"video": "videos/junk.mp4", "caption": "noise"}]
    lines += [
        {"video": "videos/00010.mp4", "caption": "   "},
        {"video": "videos/short.mp4", "caption": "a short clip"},
        {"image": "still.png", "caption": "a still picture"},
    ]
    (root / "captions.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return root


def run(src: Path, out: Path, **kw) -> dict:
    args = dict(vae_spec="tiny", text_spec="tiny", buckets=BUCKETS, fps=None, shard_size=3, progress=False)
    return preprocess(src, out, **(args | kw))


@pytest.fixture(scope="module")
def clean(source, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("clean") / "latents"
    return out, run(source, out)


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_preprocess_counts_bad_samples(clean, source):
    out, summary = clean
    assert summary["entries"] == 11 and summary["samples"] == 7 and summary["shards"] == 3
    assert summary["bad"] == {"corrupt": 1, "empty_caption": 1, "missing": 1, "too_short": 1}
    meta = json.loads((out / "meta.json").read_text())
    assert meta["format"] == "loongforge-diffusion-latents" and meta["version"] == 1
    assert (meta["latent_channels"], meta["text_dim"], meta["buckets"]) == (4, 32, BUCKETS)
    assert (meta["vae"], meta["text_encoder"], meta["source"]) == ("tiny", "tiny", str(source))
    shard = json.loads((out / "shards" / "00000.json").read_text())["samples"]
    assert [s["source"] for s in shard] == ["videos/00000.mp4", "videos/00001.mp4", "videos/00002.mp4"]
    ds = LatentDataset(out)
    assert len(ds) == 7
    assert ds.shapes() == [(4, 3, 4, 4)] * 6 + [(4, 1, 2, 4)]  # the 24 x 40 image: bucket 16x32x1
    assert ds.info(6)["bucket"] == "16x32x1" and ds.get(6)["caption"] == "a still picture"
    # a completed output is left as it is when run again
    before = files(out)
    assert run(source, out) == summary
    assert files(out) == before
    with pytest.raises(UserError, match=r"videos/missing\.mp4 \(missing\)"):
        run(source, out.with_name("error"), on_bad_sample="error")


def test_latent_dataset_matches_encoders(clean, source, encoders):
    out, _ = clean
    vae, tokenizer, encoder = encoders
    ds = LatentDataset(out)
    lines = [json.loads(x) for x in (source / "captions.jsonl").read_text().splitlines()]
    for i, line in ((0, lines[0]), (4, lines[6]), (6, lines[10])):
        sample = ds.get(i)
        assert sample["caption"] == line["caption"]
        if "image" in line:
            frames, size = read_image(source / line["image"]), (16, 32)
        else:
            frames, size = read_video(source / line["video"], FRAMES, None), (32, 32)
        want = encode_video(vae, resize_crop(frames, *size))
        assert sample["latents"].dtype == torch.float32 and torch.equal(sample["latents"], want)
        assert torch.equal(sample["text"], encode_text(tokenizer, encoder, [line["caption"]])[0])
    with pytest.raises(IndexError):
        ds.get(7)


def test_resume_gives_the_uninterrupted_output(clean, source, tmp_path, monkeypatch):
    out = tmp_path / "latents"
    write_shard = prep_mod._write_shard
    calls = []

    def interrupted(*args, **kwargs):
        write_shard(*args, **kwargs)
        calls.append(args[1])
        if len(calls) == 1:
            raise KeyboardInterrupt  # after the first shard is in place, before its progress

    monkeypatch.setattr(prep_mod, "_write_shard", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run(source, out)
    progress = json.loads((out / "progress.json").read_text())
    assert progress["entries_done"] == 0 and not progress["complete"] and not (out / "meta.json").exists()
    with pytest.raises(UserError, match="did not finish"):
        LatentDataset(out)

    def interrupted_again(*args, **kwargs):
        write_shard(*args, **kwargs)
        if args[1] == "00001":
            raise KeyboardInterrupt

    monkeypatch.setattr(prep_mod, "_write_shard", interrupted_again)
    (out / "shards" / "00007.json.tmp-1").write_text("torn")  # a temporary left by a killed writer
    with pytest.raises(KeyboardInterrupt):
        run(source, out)
    progress = json.loads((out / "progress.json").read_text())
    assert progress["entries_done"] == 5 and [s["name"] for s in progress["shards"]] == ["00000"]
    assert progress["bad"] == {"corrupt": 1, "missing": 1}
    monkeypatch.setattr(prep_mod, "_write_shard", write_shard)
    summary = run(source, out)
    assert summary == clean[1] | {"out": str(out)}
    assert files(out) == files(clean[0])  # every tensor, the shard metadata, meta and progress


def test_refuses_other_directories(clean, source, tmp_path):
    out, _ = clean
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not a preprocessing output"):
        run(source, other)
    assert files(other) == {"notes.txt": b"mine"}
    before = files(out)
    with pytest.raises(UserError, match="buckets"):
        run(source, out, buckets=["32x32x9", "32x32x1"])
    with pytest.raises(UserError, match="shard_size"):
        run(source, out, shard_size=4)
    assert files(out) == before
    (tmp_path / "meta_only").mkdir()
    (tmp_path / "meta_only" / "meta.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(UserError, match="format 'something-else'"):
        LatentDataset(tmp_path / "meta_only")
    with pytest.raises(UserError, match="no meta.json"):
        LatentDataset(tmp_path)


def test_metadata_csv_and_no_image_bucket(demo, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(demo / "videos", src / "videos")
    (src / "a.png").write_bytes((demo / "videos/00000.mp4").read_bytes()[:10])
    (src / "metadata.csv").write_text('video,caption\nvideos/00000.mp4,"a red square, moving up"\n')
    summary = run(src, tmp_path / "out", buckets=["32x32x9"])
    assert summary["samples"] == 1 and LatentDataset(tmp_path / "out").get(0)["caption"] == "a red square, moving up"
    (src / "metadata.csv").write_text("image,caption\na.png,a picture\n")
    with pytest.raises(UserError, match="no bucket has 1 frame"):
        run(src, tmp_path / "out2", buckets=["32x32x9"])
    assert not (tmp_path / "out2").exists()


# ---- Qwen-Image ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen_encoders():
    vae = load_vae("tiny", family="qwen_image")
    tokenizer, encoder = load_text_encoder("tiny", family="qwen_image")
    return vae, tokenizer, encoder


def test_qwen_text_states_match_qwen_image_pipeline(qwen_encoders, encoders):
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline
    from loongforge.diffusion.data.encoders import QWEN_PROMPT_DROP, QWEN_PROMPT_TEMPLATE

    vae, tokenizer, encoder = qwen_encoders
    assert type(vae) is AutoencoderKLQwenImage and type(encoder).__name__ == "Qwen2_5_VLForConditionalGeneration"
    text = encoder.config.text_config
    assert (text.hidden_size, text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads) == (24, 2, 2, 1)
    assert text.vocab_size == len(tokenizer) and sum(text.rope_parameters["mrope_section"]) * 2 == 24 // 2
    pipe = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=encoder, tokenizer=tokenizer, transformer=None
    )
    assert (pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx) == (QWEN_PROMPT_TEMPLATE, QWEN_PROMPT_DROP)
    captions = ["a red square moving right", "  a blue &amp; yellow\n circle   moving up ", "x"]
    cpu = torch.device("cpu")
    ours = encode_text(tokenizer, encoder, captions, family="qwen_image")
    ref, mask = pipe._get_qwen_prompt_embeds(captions, device=cpu)
    assert [len(o) for o in ours] == mask.sum(dim=1).tolist() and len({len(o) for o in ours}) == 3
    for o, r in zip(ours, ref):
        assert o.shape[1] == 24 and torch.equal(o, r[: len(o)]) and not r[len(o) :].any()
    ref, _ = pipe.encode_prompt(captions, device=cpu, max_sequence_length=20)  # the pipeline's cut
    assert all(torch.equal(o, r) for o, r in zip(encode_text(tokenizer, encoder, captions, 20, family="qwen_image"), ref))
    # seed-0 weights, frozen
    _, again = load_text_encoder("tiny", family="qwen_image")
    assert all(torch.equal(a, b) for a, b in zip(encoder.state_dict().values(), again.state_dict().values()))
    assert not any(p.requires_grad for p in encoder.parameters()) and not encoder.training
    with pytest.raises(UserError, match="needs a Qwen2_5_VLForConditionalGeneration"):
        encode_text(encoders[1], encoders[2], captions, family="qwen_image")
    with pytest.raises(UserError, match="needs a UMT5EncoderModel"):
        encode_text(tokenizer, encoder, captions)


def test_qwen_frozen_round_trip_and_latent_normalization(qwen_encoders, tmp_path):
    from diffusers import AutoencoderKLQwenImage

    vae, tokenizer, encoder = qwen_encoders
    paths = save_frozen("tiny", "tiny", tmp_path / "frozen", family="qwen_image")
    assert sorted(p.name for p in (tmp_path / "frozen").iterdir()) == ["text_encoder", "tokenizer", "vae"]
    # a later process needs no family: the directories name their classes
    for spec in (paths["vae"], tmp_path / "frozen"):
        loaded = load_vae(str(spec))
        assert type(loaded) is AutoencoderKLQwenImage
        assert all(torch.equal(a, b) for a, b in zip(vae.state_dict().values(), loaded.state_dict().values()))
    tok2, enc2 = load_text_encoder(paths["text_encoder"])
    assert type(enc2) is type(encoder) and not enc2.training
    assert all(torch.equal(a, b) for a, b in zip(encoder.state_dict().values(), enc2.state_dict().values()))
    caps = ["a green circle moving left"]
    assert torch.equal(encode_text(tok2, enc2, caps, family="qwen_image")[0], encode_text(tokenizer, encoder, caps, family="qwen_image")[0])
    # non-trivial latent stats: QwenImagePipeline's normalization (as Wan's)
    cfg_path = Path(paths["vae"]) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    mean, std = [0.5, -0.25, 1.0, 0.0], [2.0, 0.5, 1.5, 3.0]
    cfg_path.write_text(json.dumps(cfg | {"latents_mean": mean, "latents_std": std}))
    loaded = load_vae(paths["vae"])
    image = torch.rand(3, 1, SIZE, SIZE, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = encode_video(loaded, image)
    assert latents.shape == (4, 1, 4, 4)
    m, s = torch.tensor(mean).view(1, 4, 1, 1, 1), torch.tensor(std).view(1, 4, 1, 1, 1)
    with torch.no_grad():
        z = loaded.encode(image[None]).latent_dist.mode()
        want = (z - m) * (1.0 / s)  # QwenImageImg2ImgPipeline._encode_vae_image, argmax
        pixels = loaded.decode(latents[None] / (1.0 / s) + m, return_dict=False)[0][:, :, 0]  # QwenImagePipeline.__call__
    assert torch.equal(latents, want[0])
    decoded = decode_latents(loaded, latents)
    assert decoded.shape == (3, 1, SIZE, SIZE) and torch.equal(decoded[:, 0], pixels[0])


def test_preprocess_qwen_image(demo, tmp_path, qwen_encoders, clean):
    vae, tokenizer, encoder = qwen_encoders
    src = tmp_path / "src"
    shutil.copytree(demo / "videos", src / "videos")
    lines = [json.loads(x) for x in (demo / "captions.jsonl").read_text().splitlines()][:3]
    (src / "captions.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "latents"
    summary = run(src, out, buckets=["32x32x1"], family="qwen_image")
    assert (summary["samples"], summary["bad"]) == (3, {})
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["family"], meta["latent_channels"], meta["text_dim"]) == ("qwen_image", 4, 24)
    assert "family" not in json.loads((clean[0] / "meta.json").read_text())  # Wan outputs as before
    ds = LatentDataset(out)
    assert ds.family == "qwen_image" and LatentDataset(clean[0]).family == "wan"
    assert ds.shapes() == [(4, 1, 4, 4)] * 3
    for i, line in enumerate(lines):  # each video's first frame
        sample = ds.get(i)
        want = encode_video(vae, resize_crop(read_video(src / line["video"], 1, None), SIZE, SIZE))
        assert torch.equal(sample["latents"], want)
        assert torch.equal(sample["text"], encode_text(tokenizer, encoder, [line["caption"]], family="qwen_image")[0])
    assert run(src, out, buckets=["32x32x1"], family="qwen_image") == summary  # complete: left as it is
    with pytest.raises(UserError, match="family: 'qwen_image' there, None now"):
        run(src, out, buckets=["32x32x1"])
    # a video bucket is refused before anything is written
    with pytest.raises(UserError, match="bucket '32x32x9'.*1 frame"):
        run(src, tmp_path / "video", buckets=["32x32x1", "32x32x9"], family="qwen_image")
    assert not (tmp_path / "video").exists()
    with pytest.raises(UserError, match="family 'flux'"):
        run(src, tmp_path / "flux", buckets=["32x32x1"], family="flux")


def test_preprocess_i2v_condition_latents_and_clip_features(demo, tmp_path, encoders, monkeypatch):
    """Wan2.1 image-to-video (`image_spec`): each sample also holds its first frame's condition
    latents (the VAE run on that frame followed by zeros) and CLIP features (the penultimate
    hidden states of the frame as the VAE saw it), equal to the encoders run directly; an
    interrupted run resumes to the uninterrupted output, another image encoder is refused."""
    from loongforge.diffusion.data import load_image_encoder
    from PIL import Image

    vae = encoders[0]
    processor, clip = load_image_encoder("tiny")
    src = tmp_path / "src"
    shutil.copytree(demo / "videos", src / "videos")
    lines = [json.loads(x) for x in (demo / "captions.jsonl").read_text().splitlines()][:2]
    (src / "captions.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "latents"
    summary = run(src, out, buckets=["32x32x5"], shard_size=1, image_spec="tiny")
    assert (summary["samples"], summary["shards"], summary["bad"]) == (2, 2, {})
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["image_encoder"], meta["image_dim"]) == ("tiny", 16)
    ds = LatentDataset(out)
    for i, line in enumerate(lines):
        video = resize_crop(read_video(src / line["video"], 5, None), 32, 32)
        sample = ds.get(i)
        assert torch.equal(sample["latents"], encode_video(vae, video))
        first_then_zeros = torch.cat([video[:, :1], torch.zeros(3, 4, 32, 32)], dim=1)
        assert sample["condition"].shape == (4, 2, 4, 4) and torch.equal(sample["condition"], encode_video(vae, first_then_zeros))
        pixels = ((video[:, 0] + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).numpy()
        with torch.no_grad():
            want = clip(**processor(images=Image.fromarray(pixels), return_tensors="pt"), output_hidden_states=True).hidden_states[-2][0]
        assert sample["image"].shape == (17, 16) and torch.equal(sample["image"], want)
    # resumable as text-to-video outputs: interrupted after the first shard, run again
    write_shard, calls = prep_mod._write_shard, []

    def interrupted(*args, **kwargs):
        write_shard(*args, **kwargs)
        calls.append(args[1])
        raise KeyboardInterrupt

    monkeypatch.setattr(prep_mod, "_write_shard", interrupted)
    again = tmp_path / "again"
    with pytest.raises(KeyboardInterrupt):
        run(src, again, buckets=["32x32x5"], shard_size=1, image_spec="tiny")
    monkeypatch.setattr(prep_mod, "_write_shard", write_shard)
    assert calls == ["00000"] and run(src, again, buckets=["32x32x5"], shard_size=1, image_spec="tiny") == summary | {"out": str(again)}
    assert files(again) == files(out)
    with pytest.raises(UserError, match="image_encoder: 'tiny' there, None now"):
        run(src, out, buckets=["32x32x5"], shard_size=1)
    with pytest.raises(UserError, match="family 'qwen_image' takes none"):
        run(src, tmp_path / "qwen", buckets=["32x32x1"], family="qwen_image", image_spec="tiny")
