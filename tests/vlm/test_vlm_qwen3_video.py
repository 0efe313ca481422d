"""Qwen3-VL video prompts (`VisionProcessorConfig.video_timestamps`) against transformers.

Oracles: `Qwen3VLProcessor` itself for the text (its `_calculate_timestamps` and
`replace_video_token`, which build each video's `<t seconds><|vision_start|>pads<|vision_end|>`
groups, then the whole prompt tokenized at once as its `__call__` does) and
`Qwen3VLModel.get_rope_index` of a tiny model for the positions. The processor cannot be built
here with a video processor (torchvision is not installable on this CPU machine: see
test_vlm_data.py), so it gets a stand-in that hands back our own video outputs and sizes; its
text side is transformers' code, unchanged.

The format is Qwen3-VL's own (transformers 4.57's `Qwen3VLProcessor.__call__`): the rendered
`<|vision_start|><|video_pad|><|vision_end|>` is replaced whole (a bare `<|video_pad|>` alone).
transformers >= 5.10, installed here, replaces only the `<|video_pad|>` and so keeps one more
`<|vision_start|>` / `<|vision_end|>` pair around each video: `test_installed_processor_differs_by_the_outer_pair`
pins that as the one difference.
"""

from __future__ import annotations

import dataclasses
import json
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from loongforge.core.data.media import decode_frames
from loongforge.core.data.text import IGNORE
from loongforge.core.errors import UserError
from loongforge.core.foundation.mrope import TEXT, VIDEO
from loongforge.vlm.data import TINY_TOKENIZER, VisionProcessorConfig, VisionRecord, VisionSampleEncoder, to_record
from loongforge.vlm.data.encode import group_seconds

START, END, VPAD, IPAD = "<|vision_start|>", "<|vision_end|>", "<|video_pad|>", "<|image_pad|>"
# Qwen3-VL's patch and normalization; frames 64 x 64: 4 x 4 patches, 4 merged tokens a frame group
CFG = VisionProcessorConfig(
    patch_size=16,
    image_mean=(0.5, 0.5, 0.5),
    image_std=(0.5, 0.5, 0.5),
    min_pixels=4 * 32 * 32,
    max_pixels=16 * 32 * 32,
    video_min_pixels=64 * 64,
    video_max_pixels=64 * 64,
    video_fps=2.0,
    video_timestamps=True,
)
# Qwen2's pre-tokenizer (tokenizer.json of Qwen2 / Qwen2.5 / Qwen3-VL)
QWEN2_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def load(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def tok():
    return load(TINY_TOKENIZER)


@pytest.fixture(scope="module")
def qwen_tok(tmp_path_factory):
    """The tiny tokenizer with Qwen2's pre-tokenizer and the merge of " <" into one token, as
    Qwen's vocabularies have it: a timestamp after "Video 1: " then tokenizes otherwise in context
    than alone."""
    out = tmp_path_factory.mktemp("qwen_tok")
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        (out / name).write_text((TINY_TOKENIZER / name).read_text())
    spec = json.loads((TINY_TOKENIZER / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        ],
    }
    # the last merge's token becomes " <" (the vocabulary stays 0 ... 493, the added tokens after it)
    vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]
    merged = vocab.pop("".join(merges.pop()))
    vocab["Ġ<"] = merged
    merges.append(["Ġ", "<"])
    (out / "tokenizer.json").write_text(json.dumps(spec))
    t = load(out)
    assert t("a <", add_special_tokens=False).input_ids[-1] == merged and t("<", add_special_tokens=False).input_ids == [28]
    assert t.convert_ids_to_tokens(merged) == "Ġ<" and len(t) == len(load(TINY_TOKENIZER))
    return t


class VideoOutputs:
    """Stands in for Qwen3-VL's video processor (it needs torchvision): hands back the outputs set
    on it; the processor's text side reads merge_size / temporal_patch_size and the metadata."""

    merge_size, temporal_patch_size = CFG.merge_size, CFG.temporal_patch_size

    def __init__(self):
        self.outputs = {}

    def __call__(self, videos, **kwargs):
        from transformers import BatchFeature

        return BatchFeature(self.outputs)


def hf_processor(tokenizer):
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLProcessor

    class Processor(Qwen3VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor":
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    images = Qwen2VLImageProcessorPil(
        min_pixels=CFG.min_pixels,
        max_pixels=CFG.max_pixels,
        patch_size=CFG.patch_size,
        merge_size=CFG.merge_size,
        temporal_patch_size=CFG.temporal_patch_size,
        image_mean=list(CFG.image_mean),
        image_std=list(CFG.image_std),
    )
    return Processor(image_processor=images, tokenizer=tokenizer, video_processor=VideoOutputs())


@pytest.fixture(scope="module")
def hf_model(tok):
    """A tiny Qwen3-VL (get_rope_index reads the vision config's spatial_merge_size)."""
    from transformers import Qwen3VLConfig, Qwen3VLModel

    ids = {k: tok.convert_tokens_to_ids(t) for k, t in (("image", IPAD), ("video", VPAD), ("vision_start", START), ("vision_end", END))}
    cfg = Qwen3VLConfig(
        text_config=dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         vocab_size=len(tok) + 1, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "mrope_interleaved": True}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=CFG.patch_size,
                           spatial_merge_size=CFG.merge_size, temporal_patch_size=CFG.temporal_patch_size, num_position_embeddings=16, deepstack_visual_indexes=[0]),
        **{f"{k}_token_id": v for k, v in ids.items()},
    )  # fmt: skip
    return Qwen3VLModel(cfg).eval()


def write_video(path: Path, frames: int, fps: int, size: int = 64) -> Path:
    """An H.264 mp4 of `frames` frames at `fps`: a white square moving right over noise."""
    import av

    base = np.random.default_rng(0).integers(0, 120, (size, size, 3), dtype=np.uint8)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps, options={"crf": "10", "preset": "veryfast", "threads": "1"})
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for n in range(frames):
            image = base.copy()
            image[20:36, n % (size - 16) : n % (size - 16) + 16] = 255
            frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            frame.pts, frame.time_base = n, Fraction(1, fps)
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return path


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    from PIL import Image

    d = tmp_path_factory.mktemp("media")
    short = write_video(d / "short.mp4", frames=20, fps=8)  # 2.5 s: 5 frames at 2 fps, 3 groups (the last padded)
    long = write_video(d / "long.mp4", frames=48, fps=4)  # 12 s: 24 frames, 12 groups (timestamps past 10 s)
    pixels = np.random.default_rng(1).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(d / "wide.png")
    return {
        "short": short,
        "long": long,
        "image": d / "wide.png",
        "frames": {k: len(decode_frames(v, None, CFG.video_fps)) for k, v in (("short", short), ("long", long))},
    }


def two_videos(media) -> VisionRecord:
    """Text right before each video ("Look: ", " then"), an image between them, two turns."""
    return to_record(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Look: "},
                        {"type": "video", "video": str(media["short"])},
                        {"type": "text", "text": "and"},
                        {"type": "image", "image": str(media["image"])},
                        {"type": "text", "text": " then"},
                        {"type": "video", "video": str(media["long"])},
                        {"type": "text", "text": "What moves?"},
                    ],
                },
                {"role": "assistant", "content": "a square"},
                {"role": "user", "content": [{"type": "video", "video": str(media["short"])}, {"type": "text", "text": "And here?"}]},
                {"role": "assistant", "content": "the same"},
            ]
        }
    )


def metadata(n: int):
    """Our decoded frames as HF's video metadata: indices 0 ... n-1 of a video at video_fps."""
    from transformers.video_utils import VideoMetadata

    return VideoMetadata(total_num_frames=n, fps=CFG.video_fps, frames_indices=list(range(n)))


def hf_text(proc, tokenizer, record: VisionRecord, sample: dict, frames: list[int], template_kwargs: dict) -> str:
    """The prompt Qwen3-VL's processor tokenizes: the rendered conversation with each image pad and
    each video placeholder replaced, in order, by the processor's own replacement strings."""
    text = tokenizer.apply_chat_template(record.messages, tokenize=False, **template_kwargs)
    videos = {"video_grid_thw": sample["video_grid_thw"], "video_metadata": [metadata(n) for n in frames]}
    for i in range(len(frames)):
        replacement = proc.replace_video_token(videos, video_idx=i)
        wrapped = START + VPAD + END
        text = text.replace(wrapped if wrapped in text else VPAD, replacement.replace(VPAD, "\0"), 1)
    for i in range(len(record.images)):
        text = text.replace(
            IPAD, proc.replace_image_token({"image_grid_thw": sample["image_grid_thw"]}, image_idx=i).replace(IPAD, "\1"), 1
        )
    return text.replace("\0", VPAD).replace("\1", IPAD)


def rope_index(hf_model, sample: dict) -> torch.Tensor:
    positions, _ = hf_model.get_rope_index(
        sample["input_ids"][None],
        sample["mm_token_type_ids"][None],
        image_grid_thw=sample["image_grid_thw"],
        video_grid_thw=sample["video_grid_thw"],
        attention_mask=torch.ones_like(sample["input_ids"])[None],
    )
    return positions[:, 0]


def trained_text(tokenizer, sample: dict) -> str:
    ids, labels = sample["input_ids"].tolist(), sample["labels"].tolist()
    return tokenizer.decode([t for t, lab in zip(ids, labels) if lab != IGNORE])


# ---- timestamps ----------------------------------------------------------------------------------


def test_group_seconds_are_the_processors_timestamps(tok):
    proc = hf_processor(tok)
    for n in (1, 2, 3, 5, 8, 24, 31):
        for fps in (2.0, 1.0, 0.5, 3.0, 29.97):
            for tp in (1, 2, 3):
                assert group_seconds(n, fps, tp) == proc._calculate_timestamps(list(range(n)), fps, tp), (n, fps, tp)
    assert group_seconds(5, 2.0, 2) == [0.25, 1.25, 2.0]  # the 5th frame's group padded with itself


# ---- the sample ------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["tiny", "qwen"])
@pytest.mark.parametrize("vision_id", [False, True])
def test_video_prompt_tokens_positions_and_labels(which, vision_id, tok, qwen_tok, hf_model, media):
    tokenizer = tok if which == "tiny" else qwen_tok
    kw = {"add_vision_id": True} if vision_id else {}  # "Video 1: " before each video
    enc = VisionSampleEncoder(tokenizer, CFG, max_length=2048, template_kwargs=kw)
    record = two_videos(media)
    ours = enc.encode(record)
    frames = [media["frames"][k] for k in ("short", "long", "short")]
    assert frames == [5, 24, 5]
    assert ours["video_grid_thw"].tolist() == [[3, 4, 4], [12, 4, 4], [3, 4, 4]]  # one row per video
    assert ours["second_per_grid_ts"] is None
    assert ours["pixel_values_videos"].shape == (3 * 16 + 12 * 16 + 3 * 16, 3 * 2 * 16 * 16)
    assert ours["image_grid_thw"].tolist() == [[1, 4, 6]]

    # (1) the tokens: the processor's prompt tokenized whole
    proc = hf_processor(tokenizer)
    text = hf_text(proc, tokenizer, record, ours, frames, kw)
    want = tokenizer(text, add_special_tokens=False).input_ids
    assert ours["input_ids"].tolist() == want
    # ... which is, per frame group, the timestamp's tokens, a start, 4 pads, an end
    start, end, vpad = (tokenizer.convert_tokens_to_ids(t) for t in (START, END, VPAD))
    ids = ours["input_ids"].tolist()
    groups = [i for i in range(len(ids)) if ids[i] == start and ids[i + 1] == vpad]
    seconds = [t for n in frames for t in proc._calculate_timestamps(list(range(n)), CFG.video_fps, CFG.temporal_patch_size)]
    assert len(groups) == len(seconds) == 3 + 12 + 3
    for i, t in zip(groups, seconds):
        assert ids[i : i + 6] == [start, vpad, vpad, vpad, vpad, end]
        stamp = tokenizer(f"<{t:.1f} seconds>", add_special_tokens=False).input_ids
        before = tokenizer.decode(ids[max(0, i - len(stamp) - 1) : i])
        assert before.endswith(f"<{t:.1f} seconds>"), (before, t)
        if ids[i - len(stamp) - 1] == end:  # a timestamp between two groups: its own tokens
            assert ids[i - len(stamp) : i] == stamp
    assert f"<11.2 seconds>{START}" in text and text.count(START) == 18 + 1 and VPAD + END + START not in text
    naive_first = (
        tokenizer("Video 1: ", add_special_tokens=False).input_ids + tokenizer("<0.2 seconds>", add_special_tokens=False).input_ids
    )
    if vision_id and which == "qwen":  # the first timestamp merged with the text before it (" <"), as whole
        assert "Ġ<" in tokenizer.convert_ids_to_tokens(ids)
        assert not any(ids[i : i + len(naive_first)] == naive_first for i in range(len(ids)))
    # token types: pads video, everything inserted text
    types = ours["mm_token_type_ids"]
    assert torch.equal(types == VIDEO, ours["input_ids"] == vpad)
    assert torch.equal(types, torch.tensor(proc.create_mm_token_type_ids([want])[0]))

    # (2) positions: HF's get_rope_index on our ids, token types and per-video grids
    assert ours["position_ids"].dtype == torch.long and ours["position_ids"].shape == (3, len(ids))
    assert torch.equal(ours["position_ids"], rope_index(hf_model, ours))
    for i in groups:  # each group its own 2 x 2 item at time 0, from the position after its start token
        p = int(ours["position_ids"][0, i]) + 1
        assert ours["position_ids"][:, i + 1 : i + 5].tolist() == [[p] * 4, [p, p, p + 1, p + 1], [p, p + 1] * 2]
        assert ours["position_ids"][:, i + 5].tolist() == [p + 2] * 3  # the end: after the item's largest side

    # (3) labels: the answers only, nothing inserted
    assert ours["labels"].shape == ours["input_ids"].shape
    kept = ours["labels"] != IGNORE
    assert torch.equal(ours["labels"][kept], ours["input_ids"][kept])
    assert trained_text(tokenizer, ours) == "a square<|im_end|>\nthe same<|im_end|>\n"


def test_text_run_before_a_video_keeps_its_labels(qwen_tok, media):
    """Trained prompt text right before a video (train_on_prompt) stays trained where its tokens
    stay; the token the timestamp merged into (" " -> " <") and all inserted tokens are not."""
    kw = {"add_vision_id": True}
    enc = VisionSampleEncoder(qwen_tok, CFG, max_length=2048, template_kwargs=kw, train_on_prompt=True)
    record = to_record(
        {
            "messages": [
                {"role": "user", "content": [{"type": "video", "video": str(media["short"])}, {"type": "text", "text": "What?"}]},
                {"role": "assistant", "content": "a square"},
            ]
        }
    )
    ours = enc.encode(record)
    rendered = qwen_tok.apply_chat_template(record.messages, tokenize=False, **kw)
    assert "user\nVideo 1: " + START + VPAD + END + "What?" in rendered
    assert trained_text(qwen_tok, ours) == rendered.replace("Video 1: " + START + VPAD + END, "Video 1:")
    assert (
        ours["input_ids"].tolist()
        == qwen_tok(hf_text(hf_processor(qwen_tok), qwen_tok, record, ours, [5], kw), add_special_tokens=False).input_ids
    )


def test_bare_video_pad_is_replaced_alone(tok, qwen_tok, hf_model, media):
    """A `<|video_pad|>` without the start / end around it (a text that holds it) is replaced
    alone, as the processor does ("vllm may input video token directly")."""
    for tokenizer in (tok, qwen_tok):
        record = VisionRecord(
            messages=[
                {"role": "user", "content": [{"type": "text", "text": "Clip " + VPAD + " here"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
            ],
            videos=[str(media["short"])],
        )
        ours = VisionSampleEncoder(tokenizer, CFG, max_length=2048).encode(record)
        text = hf_text(hf_processor(tokenizer), tokenizer, record, ours, [5], {})
        assert "Clip <0.2 seconds>" + START in text and text.count(START) == 3
        assert ours["input_ids"].tolist() == tokenizer(text, add_special_tokens=False).input_ids
        assert torch.equal(ours["position_ids"], rope_index(hf_model, ours))
        assert trained_text(tokenizer, ours) == "ok<|im_end|>\n"


def test_installed_processor_differs_by_the_outer_pair(tok, media):
    """transformers >= 5.10's `Qwen3VLProcessor.__call__` (installed) replaces the `<|video_pad|>`
    only, keeping the template's start / end around the video's groups: its ids are ours with that
    pair put back, its token types ours likewise, its image pixels ours."""
    from PIL import Image

    enc = VisionSampleEncoder(tok, CFG, max_length=2048)
    record = two_videos(media)
    ours = enc.encode(record)
    frames = [media["frames"][k] for k in ("short", "long", "short")]
    proc = hf_processor(tok)
    proc.video_processor.outputs = {
        "pixel_values_videos": ours["pixel_values_videos"],
        "video_grid_thw": ours["video_grid_thw"],
        "video_metadata": [metadata(n) for n in frames],
    }
    text = tok.apply_chat_template(record.messages, tokenize=False)
    dummy = [np.zeros((n, 64, 64, 3), np.uint8) for n in frames]
    hf = proc(text=[text], images=[Image.open(media["image"]).convert("RGB")], videos=dummy, return_tensors="pt")
    assert torch.equal(hf["pixel_values"], ours["pixel_values"]) and torch.equal(hf["image_grid_thw"], ours["image_grid_thw"])
    start, end = tok.convert_tokens_to_ids(START), tok.convert_tokens_to_ids(END)
    ids, types = ours["input_ids"].tolist(), ours["mm_token_type_ids"].tolist()
    # put a start before each video's first timestamp and an end after its last group
    secs = [proc._calculate_timestamps(list(range(n)), CFG.video_fps, CFG.temporal_patch_size) for n in frames]
    out, out_types, i, v = [], [], 0, 0
    while i < len(ids):
        stamp = tok(f"<{secs[v][0]:.1f} seconds>", add_special_tokens=False).input_ids if v < len(frames) else None
        if stamp and ids[i : i + len(stamp)] == stamp and ids[i + len(stamp)] == start:
            j = i
            for _ in secs[v]:  # past the video's groups: timestamp, start, pads, end
                j = ids.index(end, j) + 1
            out += [start] + ids[i:j] + [end]
            out_types += [TEXT] + types[i:j] + [TEXT]
            i, v = j, v + 1
        else:
            out.append(ids[i])
            out_types.append(types[i])
            i += 1
    assert v == 3 and len(out) == len(ids) + 6
    assert hf["input_ids"][0].tolist() == out
    assert hf["mm_token_type_ids"][0].tolist() == out_types


# ---- config --------------------------------------------------------------------------------------


def test_config_field_and_hf_directories(tmp_path, tok):
    assert VisionProcessorConfig().video_timestamps is False  # Qwen2-VL / Qwen2.5-VL: one run of pads per video
    with pytest.raises(UserError, match=r"unknown keys \['videos'\]"):
        VisionSampleEncoder(tok, {"videos": True})
    assert VisionSampleEncoder(tok, {"video_timestamps": True}).config.video_timestamps
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"patch_size": 16, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}))
    for model_type, stamped in (("qwen3_vl", True), ("qwen2_5_vl", False), ("llava_onevision", False)):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "vision_config": {}}))
        assert VisionProcessorConfig.from_hf(tmp_path).video_timestamps is stamped
    assert VisionProcessorConfig.from_hf(tmp_path, video_timestamps=True).video_timestamps


def test_samples_without_video_are_as_before(tok, media):
    """video_timestamps changes videos only: a text-only and an image sample encode the same."""
    plain = VisionSampleEncoder(tok, dataclasses.replace(CFG, video_timestamps=False), max_length=512)
    stamped = VisionSampleEncoder(tok, CFG, max_length=512)
    text = to_record({"conversations": [{"from": "human", "value": "What is two plus two?"}, {"from": "gpt", "value": "four"}]})
    image = to_record(
        {"image": str(media["image"]), "conversations": [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "noise"}]}
    )
    for record in (text, image):
        a, b = plain.encode(record), stamped.encode(record)
        assert a.keys() == b.keys()
        for k in a:
            assert (a[k] is None and b[k] is None) or torch.equal(a[k], b[k]), k
    assert (b["mm_token_type_ids"] != VIDEO).all() and (a["mm_token_type_ids"] != TEXT).sum() == 6
