"""loongforge.vlm.data: the tiny tokenizer, the demo set, the readers, the sample encoder and the
bad-sample accounting.

Oracles: transformers' `Qwen2_5_VLProcessor` (the text's pad expansion, pixel values and grids,
token types) and `Qwen2_5_VLModel.get_rope_index` (M-RoPE positions) of a tiny
`Qwen2_5_VLForConditionalGeneration` whose image / video / vision-start token ids are the tiny
tokenizer's. The processor cannot be built here as it is: torchvision is not installable on this
CPU machine, so transformers' `BaseVideoProcessor` is a dummy class and the processor's
constructor refuses any video processor, even None. The test's subclass skips that one class
check and nothing else; the processor then runs its own `__call__` on text and images with the
PIL `Qwen2VLImageProcessor`. Videos cannot go through it (the video processor needs torchvision),
so a video's patches are checked against Qwen2-VL's video patch layout (the view / permute of
transformers' `Qwen2VLVideoProcessor.patchify`, restated here) applied to the decoded frames, and
its pads and positions against `get_rope_index`.
"""

from __future__ import annotations

import base64
import dataclasses
import importlib.util
import inspect
import json
from collections import Counter
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from loongforge.core.data.media import decode_frames
from loongforge.core.data.text import IGNORE, SFTTokenizer
from loongforge.core.errors import UserError
from loongforge.vlm.data import (
    TINY_TOKENIZER,
    VisionProcessorConfig,
    VisionRecord,
    VisionSampleEncoder,
    encode_all,
    read_records,
    to_record,
    write_demo_dataset,
)
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
SPECIAL = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# small images: 4 to 16 merged tokens each; a video frame 56 x 56 (4 merged tokens a frame pair)
CFG = VisionProcessorConfig(
    min_pixels=4 * 28 * 28,
    max_pixels=16 * 28 * 28,
    video_min_pixels=56 * 56,
    video_max_pixels=56 * 56,
    video_fps=2.0,
    tokens_per_second=2,
)


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TINY_TOKENIZER))


@pytest.fixture(scope="module")
def encoder(tok):
    return VisionSampleEncoder(tok, CFG, max_length=1024)


@pytest.fixture(scope="module")
def processor(tok):
    """transformers' Qwen2_5_VLProcessor with the PIL image processor of CFG (see the module docstring)."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessorPil

    class ImageOnlyProcessor(Qwen2_5_VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor":
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    images = Qwen2VLImageProcessorPil(
        min_pixels=CFG.min_pixels,
        max_pixels=CFG.max_pixels,
        patch_size=CFG.patch_size,
        temporal_patch_size=CFG.temporal_patch_size,
        merge_size=CFG.merge_size,
    )
    return ImageOnlyProcessor(image_processor=images, tokenizer=tok, video_processor=None)


@pytest.fixture(scope="module")
def hf_vlm(tok):
    """A tiny Qwen2.5-VL whose vision token ids are the tiny tokenizer's."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    cfg = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         vocab_size=len(tok), rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, spatial_merge_size=CFG.merge_size,
                           patch_size=CFG.patch_size, temporal_patch_size=CFG.temporal_patch_size, tokens_per_second=CFG.tokens_per_second),
        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration(cfg).eval()


def rope_index(hf_vlm, sample: dict, types: torch.Tensor) -> torch.Tensor:
    """HF's position rows [3, T] for one sample (`types`: the token types HF's processor gives)."""
    ids = sample["input_ids"][None]
    kw = dict(
        image_grid_thw=sample["image_grid_thw"],
        video_grid_thw=sample["video_grid_thw"],
        second_per_grid_ts=sample["second_per_grid_ts"],
        attention_mask=torch.ones_like(ids),
    )
    if "mm_token_type_ids" in inspect.signature(hf_vlm.model.get_rope_index).parameters:
        kw["mm_token_type_ids"] = types[None]
    positions, _ = hf_vlm.model.get_rope_index(ids, **kw)
    return positions[:, 0]


def noise_png(path: Path, width: int, height: int, seed: int) -> Path:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


def trained_text(tok, sample: dict) -> str:
    ids, labels = (torch.as_tensor(sample[k]).tolist() for k in ("input_ids", "labels"))
    return tok.decode([t for t, lab in zip(ids, labels) if lab != IGNORE])


# ---- tokenizer -----------------------------------------------------------------------------------


def test_tiny_tokenizer_loads_renders_images_and_masks(tok, tmp_path):
    assert len(tok) == 500 and tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    ids = [tok.convert_tokens_to_ids(t) for t in SPECIAL]
    assert ids == list(range(494, 500))
    assert tok("a<|image_pad|><|video_pad|>b", add_special_tokens=False).input_ids[1:3] == ids[4:6]  # one token each
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "\nWhat color is the shape?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "And this?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "blue"}]},
    ]
    assert tok.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>\nWhat color is the shape?<|im_end|>\n"
        "<|im_start|>assistant\nred<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>And this?<|im_end|>\n"
        "<|im_start|>assistant\nblue<|im_end|>\n"
    )
    assert tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True).endswith("<|im_start|>assistant\n")
    out = SFTTokenizer(tok)(messages)
    assert trained_text(tok, out) == "red<|im_end|>\nblue<|im_end|>\n"
    # the shipped files are what tools/make_vlm_tiny_tokenizer.py writes
    spec = importlib.util.spec_from_file_location("make_vlm_tiny_tokenizer", ROOT / "tools" / "make_vlm_tiny_tokenizer.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.OUT = tmp_path / "tok"
    script.main()
    shipped = sorted(p.name for p in TINY_TOKENIZER.iterdir())
    assert shipped == sorted(p.name for p in script.OUT.iterdir()) and "tokenizer.json" in shipped
    for name in shipped:
        assert (script.OUT / name).read_bytes() == (TINY_TOKENIZER / name).read_bytes(), name


# ---- demo set ------------------------------------------------------------------------------------


def _shape_of(pixels: np.ndarray) -> tuple[tuple, str]:
    """(colour, shape) of the one shape on the demo's background, from the pixels alone: the shape's
    area over its bounding box's is 1 for a square, pi/4 for a circle, 1/2 for a triangle."""
    from loongforge.vlm.data.demo import BACKGROUND

    inside = np.any(pixels != np.array(BACKGROUND), axis=-1)
    rows, cols = np.nonzero(inside)
    fill = inside.sum() / ((rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1))
    colours, counts = np.unique(pixels[inside], axis=0, return_counts=True)
    shape = "square" if fill > 0.93 else "circle" if fill > 0.65 else "triangle"
    return tuple(int(v) for v in colours[counts.argmax()]), shape


def test_demo_dataset_deterministic_truthful_and_refuses_non_empty(tmp_path, tok, encoder):
    from loongforge.vlm.data.demo import COLORS

    a = write_demo_dataset(tmp_path / "a", samples=24, seed=0)
    b = write_demo_dataset(tmp_path / "b", samples=24, seed=0)
    c = write_demo_dataset(tmp_path / "c", samples=24, seed=1)
    files = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())
    assert files == sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file())
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    assert (a / "data.json").read_bytes() != (c / "data.json").read_bytes()
    rows = json.loads((a / "data.json").read_text())
    assert len(rows) == 24 and sum("image" not in r for r in rows) == 3
    sizes, kinds = set(), Counter()
    for r in rows:
        if "image" not in r:
            continue
        image = Image.open(a / r["image"])
        sizes.add(image.size)
        assert all(56 <= s <= 112 and s % 28 == 0 for s in image.size)
        colour, shape = _shape_of(np.asarray(image.convert("RGB")))
        turns = r["conversations"]
        assert turns[0]["value"].startswith("<image>\n")
        for q, ans in zip(turns[::2], turns[1::2]):
            assert ans["value"] == ({v: k for k, v in COLORS.items()}[colour] if "color" in q["value"] else shape)
            kinds[ans["value"]] += 1
    assert len(sizes) > 3 and {"circle", "square", "triangle"} <= set(kinds)
    # the set reads and encodes with no bad sample
    samples, bad = encode_all(read_records(a / "data.json"), encoder, progress=False)
    assert len(samples) == 24 and not bad
    assert sum(s["pixel_values"] is None for s in samples) == 3
    # refused: a non-empty directory, left as it is; an empty one is fine
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="not empty"):
        write_demo_dataset(tmp_path / "busy", samples=4)
    assert [p.name for p in (tmp_path / "busy").iterdir()] == ["keep.txt"]
    with pytest.raises(UserError, match="not empty"):
        write_demo_dataset(a, samples=24)
    (tmp_path / "empty").mkdir()
    assert (write_demo_dataset(tmp_path / "empty", samples=2) / "images" / "00000.png").is_file()


# ---- readers -------------------------------------------------------------------------------------

QUESTION = ("Look: ", " and ", " Which one is red?")
ANSWER = "the first"
WANT_MESSAGES = [
    {"role": "system", "content": [{"type": "text", "text": "Answer in few words."}]},
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "Look: "},
            {"type": "image"},
            {"type": "text", "text": " and "},
            {"type": "image"},
            {"type": "text", "text": " Which one is red?"},
        ],
    },
    {"role": "assistant", "content": [{"type": "text", "text": "the first"}]},
    {"role": "user", "content": [{"type": "text", "text": "Sure?"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "yes"}]},
]


def _write_formats(d: Path) -> dict[str, tuple[Path, dict]]:
    """The same two-image conversation in every format: {name: (data file, read_records kwargs)}."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (d / "media").mkdir(parents=True)
    red, blue = d / "media" / "red.png", d / "media" / "blue.png"
    Image.new("RGB", (70, 50), (220, 30, 30)).save(red)
    Image.new("RGB", (40, 90), (30, 30, 220)).save(blue)
    q, out = QUESTION, {}
    system = "Answer in few words."

    llava = [
        {
            "id": "x1",
            "image": ["red.png", "blue.png"],
            "system": system,
            "conversations": [
                {"from": "human", "value": f"{q[0]}<image>{q[1]}<image>{q[2]}"},
                {"from": "gpt", "value": ANSWER},
                {"from": "human", "value": "Sure?"},
                {"from": "gpt", "value": "yes"},
            ],
        }
    ]
    (d / "llava.json").write_text(json.dumps(llava))
    out["llava"] = (d / "llava.json", {"media_root": d / "media"})

    def parts(first, second):
        return [{"type": "text", "text": q[0]}, first, {"type": "text", "text": q[1]}, second, {"type": "text", "text": q[2]}]

    sharegpt = {
        "system": system,
        "conversations": [
            {"from": "human", "value": parts({"type": "image", "image": "media/red.png"}, {"type": "image", "image": "media/blue.png"})},
            {"from": "gpt", "value": ANSWER},
            {"from": "human", "value": [{"type": "text", "text": "Sure?"}]},
            {"from": "gpt", "value": "yes"},
        ],
    }
    (d / "sharegpt.jsonl").write_text(json.dumps(sharegpt) + "\n")
    out["sharegpt"] = (d / "sharegpt.jsonl", {})

    data_uri = "data:image/png;base64," + base64.b64encode(red.read_bytes()).decode()
    openai = {
        "messages": [
            {"role": "system", "content": system},
            {
                "role": "user",
                "content": parts({"type": "image_url", "image_url": {"url": data_uri}}, {"type": "image", "image": str(blue)}),
            },
            {"role": "assistant", "content": [{"type": "text", "text": ANSWER}]},
            {"role": "user", "content": "Sure?"},
            {"role": "assistant", "content": "yes"},
        ]
    }
    (d / "openai.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n" + json.dumps(openai) + "\n")
    out["openai"] = (d / "openai.jsonl", {})

    # HF datasets' layout: chat parts with empty fields, and an Image column ({"bytes", "path"} structs)
    def row_parts(items):
        return [{"type": t, "text": x} for t, x in items]

    table = pa.table(
        {
            "messages": [
                [
                    {"role": "system", "content": row_parts([("text", system)])},
                    {
                        "role": "user",
                        "content": row_parts([("text", q[0]), ("image", None), ("text", q[1]), ("image", None), ("text", q[2])]),
                    },
                    {"role": "assistant", "content": row_parts([("text", ANSWER)])},
                    {"role": "user", "content": row_parts([("text", "Sure?")])},
                    {"role": "assistant", "content": row_parts([("text", "yes")])},
                ]
            ],
            "images": [[{"bytes": red.read_bytes(), "path": "red.png"}, {"bytes": None, "path": "media/blue.png"}]],
        }
    )
    pq.write_table(table, d / "chat.parquet")
    out["parquet"] = (d / "chat.parquet", {})
    return out


def _bytes(source) -> bytes:
    return source if isinstance(source, bytes) else Path(source).read_bytes()


def test_every_format_reads_to_the_same_record(tmp_path, encoder):
    files = _write_formats(tmp_path)
    red, blue = (tmp_path / "media" / n for n in ("red.png", "blue.png"))
    encoded = []
    for name, (path, kw) in files.items():
        records = list(read_records(path, **kw))
        record = records[-1]
        assert isinstance(record, VisionRecord), (name, record)
        assert record.messages == WANT_MESSAGES, name
        assert [_bytes(s) for s in record.images] == [red.read_bytes(), blue.read_bytes()], name
        assert record.videos == [] and str(path) in record.where
        encoded.append(encoder.encode(record))
    for other in encoded[1:]:
        for key in ("input_ids", "labels", "position_ids", "pixel_values", "image_grid_thw"):
            assert torch.equal(other[key], encoded[0][key]), key
    # a file path source is absolute, bytes stay bytes
    llava = next(iter(read_records(files["llava"][0], media_root=tmp_path / "media")))
    assert llava.images == [str(red.resolve()), str(blue.resolve())]
    assert isinstance(next(r for r in read_records(files["parquet"][0])).images[0], bytes)
    # a directory: every data file's rows (5), in file name order
    items = list(read_records(tmp_path, media_root=tmp_path / "media"))
    assert [Path(i.where.split("[")[0]).name for i in items] == [
        "chat.parquet",
        "llava.json",
        "openai.jsonl",
        "openai.jsonl",
        "sharegpt.jsonl",
    ]


def test_reader_bad_rows(tmp_path):
    Image.new("RGB", (30, 30)).save(tmp_path / "a.png")

    def reason(row, **kw):
        with pytest.raises(Exception) as e:
            to_record(row, root=tmp_path, **kw)
        return getattr(e.value, "reason", repr(e.value))

    chat = lambda text: [{"from": "human", "value": text}, {"from": "gpt", "value": "ok"}]  # noqa: E731
    assert reason({"image": ["a.png"], "conversations": chat("<image> and <image>")}) == "placeholder_mismatch"
    assert reason({"image": ["a.png", "a.png"], "conversations": chat("<image>")}) == "placeholder_mismatch"
    assert reason({"image": "a.png", "conversations": chat("no marker")}) == "placeholder_mismatch"
    assert reason({"conversations": chat("<video>")}) == "placeholder_mismatch"
    assert reason({"image": "gone.png", "conversations": chat("<image>")}) == "missing_media"
    assert reason({"image": "https://x.org/a.png", "conversations": chat("<image>")}) == "remote_media"
    assert reason({"image": "data:image/png;base64,@@", "conversations": chat("<image>")}) == "corrupt_media"
    assert reason({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}, {"role": "assistant", "content": "x"}]}) == (
        "unsupported_content"
    )
    assert reason({"image": "a.png", "conversations": [{"from": "human", "value": "<image>"}]}) == "no_assistant_turn"  # core's check
    ok = to_record({"video": "a.png", "image": "a.png", "conversations": chat("<video> then <image>")}, root=tmp_path)
    assert [p["type"] for p in ok.messages[0]["content"]] == ["video", "text", "image"]
    assert ok.videos == ok.images == [str((tmp_path / "a.png").resolve())]


# ---- the encoder against transformers --------------------------------------------------------------


def test_images_and_text_match_qwen25vl_processor_and_rope_index(tmp_path, tok, encoder, processor, hf_vlm):
    wide, tall = noise_png(tmp_path / "wide.png", 84, 56, 1), noise_png(tmp_path / "tall.png", 60, 130, 2)
    two = to_record(
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "First "}, {"type": "image", "image": "wide.png"}]},
                {"role": "assistant", "content": "a wide one"},
                {"role": "user", "content": [{"type": "image", "image": "tall.png"}, {"type": "text", "text": "and this?"}]},
                {"role": "assistant", "content": "a tall one"},
            ]
        },
        root=tmp_path,
    )
    text_only = to_record({"conversations": [{"from": "human", "value": "What is two plus two?"}, {"from": "gpt", "value": "four"}]})
    for record, images in ((two, [wide, tall]), (text_only, [])):
        ours = encoder.encode(record)
        text = tok.apply_chat_template(record.messages, tokenize=False)
        pil = [Image.open(p).convert("RGB") for p in images]
        want = processor(text=[text], images=pil or None, return_tensors="pt")
        assert torch.equal(ours["input_ids"], want["input_ids"][0])
        assert torch.equal(ours["mm_token_type_ids"], want["mm_token_type_ids"][0].long())
        if images:
            assert torch.equal(ours["image_grid_thw"], want["image_grid_thw"])
            assert ours["pixel_values"].dtype == torch.float32 and torch.equal(ours["pixel_values"], want["pixel_values"])
            assert ours["image_grid_thw"].tolist() == [[1, 4, 6], [1, 10, 4]]  # sizes differ: 56x84 kept, 130x60 -> 140x56
        else:
            assert ours["pixel_values"] is None and ours["image_grid_thw"] is None and "pixel_values" not in want
        assert ours["pixel_values_videos"] is None and ours["video_grid_thw"] is None and ours["second_per_grid_ts"] is None
        hf = rope_index(hf_vlm, ours, want["mm_token_type_ids"][0])
        assert ours["position_ids"].shape == (3, len(ours["input_ids"])) and ours["position_ids"].dtype == torch.long
        assert torch.equal(ours["position_ids"], hf)
        # labels: the assistant turns only, never a vision pad
        assert ours["labels"].shape == ours["input_ids"].shape
        kept = ours["labels"] != IGNORE
        assert torch.equal(ours["labels"][kept], ours["input_ids"][kept])
        assert not (kept & (ours["mm_token_type_ids"] != 0)).any()
    assert trained_text(tok, encoder.encode(two)) == "a wide one<|im_end|>\na tall one<|im_end|>\n"
    # negative control: the other image order gives other grids, positions and pixels
    swapped = VisionRecord(two.messages, two.images[::-1])
    other = encoder.encode(swapped)
    assert not torch.equal(other["image_grid_thw"], encoder.encode(two)["image_grid_thw"])
    assert not torch.equal(other["position_ids"], encoder.encode(two)["position_ids"])


def write_video(path: Path, frames: int, fps: int, size: int = 56) -> Path:
    """A tiny H.264 mp4: a white square moving right over noise."""
    import av

    rng = np.random.default_rng(0)
    base = rng.integers(0, 120, (size, size, 3), dtype=np.uint8)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps, options={"crf": "10", "preset": "veryfast", "threads": "1"})
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for n in range(frames):
            image = base.copy()
            image[20:36, 2 * n : 2 * n + 16] = 255
            frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            frame.pts, frame.time_base = n, Fraction(1, fps)
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return path


def qwen2vl_video_patches(frames: np.ndarray, cfg: VisionProcessorConfig) -> torch.Tensor:
    """Patches of uint8 frames [F, H, W, 3] already of a size the processor keeps: rescaled and
    normalized, then the view / permute of transformers' Qwen2VLVideoProcessor.patchify."""
    x = torch.from_numpy(frames).permute(0, 3, 1, 2).float() * (1 / 255)
    x = (x - torch.tensor(cfg.image_mean)[:, None, None]) / torch.tensor(cfg.image_std)[:, None, None]
    videos = x[None]
    tp, p, m = cfg.temporal_patch_size, cfg.patch_size, cfg.merge_size
    if pad := -videos.shape[1] % tp:
        videos = torch.cat((videos, videos[:, -1:].expand(-1, pad, -1, -1, -1)), dim=1)
    b, f, c, h, w = videos.shape
    gt, gh, gw = f // tp, h // p, w // p
    patches = videos.view(b, gt, tp, c, gh // m, m, p, gw // m, m, p).permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    return patches.reshape(gt * gh * gw, c * tp * p * p)


def test_video_sample_pads_patches_and_positions(tmp_path, tok, encoder, hf_vlm):
    clip = write_video(tmp_path / "clip.mp4", frames=20, fps=8)  # 2.5 s: 5 frames at 2 fps, padded to 6
    record = to_record(
        {"video": "clip.mp4", "conversations": [{"from": "human", "value": "<video>\nWhat moves?"}, {"from": "gpt", "value": "a square"}]},
        root=tmp_path,
    )
    ours = encoder.encode(record)
    frames = decode_frames(clip, None, CFG.video_fps)
    assert len(frames) == 5
    assert ours["video_grid_thw"].tolist() == [[3, 4, 4]]
    assert torch.allclose(ours["second_per_grid_ts"], torch.tensor([CFG.temporal_patch_size / CFG.video_fps]))
    want = qwen2vl_video_patches(frames, CFG)
    assert ours["pixel_values_videos"].shape == want.shape == (48, 3 * 2 * 14 * 14)
    assert torch.allclose(ours["pixel_values_videos"], want, atol=1e-5, rtol=0)
    # the text: one pad per merged patch, as the processor's expansion rule says
    video_pad = tok.convert_tokens_to_ids("<|video_pad|>")
    text_ids = tok(tok.apply_chat_template(record.messages, tokenize=False), add_special_tokens=False).input_ids
    i = text_ids.index(video_pad)
    assert ours["input_ids"].tolist() == text_ids[:i] + [video_pad] * 12 + text_ids[i + 1 :]
    types = (ours["input_ids"] == hf_vlm.config.video_token_id).long() * 2
    assert torch.equal(ours["mm_token_type_ids"], types)
    hf = rope_index(hf_vlm, ours, types)
    assert torch.equal(ours["position_ids"], hf)
    start = ours["position_ids"][0, i]
    assert ours["position_ids"][0, i : i + 12].tolist() == [start] * 4 + [start + 2] * 4 + [start + 4] * 4  # 1 s a grid x 2 tokens/s
    assert ours["pixel_values"] is None and trained_text(tok, ours) == "a square<|im_end|>\n"


# ---- bad samples ---------------------------------------------------------------------------------


def test_bad_samples_counted_by_reason_and_error_mode(tmp_path, tok):
    Image.new("RGB", (56, 56), (200, 20, 20)).save(tmp_path / "good.png")
    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not an image")
    Image.new("RGB", (112, 112), (20, 20, 200)).save(tmp_path / "big.png")

    def row(image, human="<image>\nWhat color?", answer="red"):
        r = {"conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": answer}]}
        if image is not None:
            r["image"] = image
        return r

    rows = [
        row("good.png"),
        row("corrupt.png"),
        row("missing.png"),
        row(["good.png"], human="<image> <image> two?"),
        row("big.png"),  # 16 image tokens: 76 > 70
        row(None, human="What color?", answer="red " * 40),  # text alone over max_length
        row("good.png", answer="blue"),
    ]
    (tmp_path / "data.json").write_text(json.dumps(rows))
    short = VisionSampleEncoder(tok, max_length=70, **dataclasses.asdict(CFG))  # the config's fields as keywords
    assert short.config == CFG
    assert len(short.encode(to_record(rows[0], root=tmp_path))["input_ids"]) == 64  # 4 image tokens
    samples, bad = encode_all(read_records(tmp_path / "data.json"), short, progress=False)
    assert bad == Counter(corrupt_media=1, missing_media=1, placeholder_mismatch=1, over_long=2)
    assert len(samples) == 2 and [trained_text(tok, s) for s in samples] == ["red<|im_end|>\n", "blue<|im_end|>\n"]
    with pytest.raises(UserError, match=r"data\.json\[1\]: corrupt_media: .*corrupt\.png.*on_bad_sample=skip"):
        encode_all(read_records(tmp_path / "data.json"), short, on_bad_sample="error", progress=False)
    with pytest.raises(UserError, match="none of the 2 records"):
        encode_all(list(read_records(tmp_path / "data.json"))[1:3], short, progress=False)
    with pytest.raises(UserError, match="choose skip or error"):
        encode_all([], short, on_bad_sample="drop")
    with pytest.raises(UserError, match="has no <image> token"):
        VisionSampleEncoder(tok, CFG, image_token="<image>")
