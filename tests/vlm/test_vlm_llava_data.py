"""loongforge.vlm.data.llava: LLaVA-OneVision samples and the tiny LLaVA tokenizer.

Oracle: transformers' `LlavaOnevisionProcessor` with the PIL `LlavaOnevisionImageProcessorPil`
(LLaVA-OneVision's normalization, the config's tile size and pinpoints) and the tiny LLaVA
tokenizer, applied to the chat template's rendering of each record and the same PIL images, one
sample's images batched as `apply_chat_template` batches them (`images=[[...]]`). Its constructor
refuses any video processor here, even None (transformers' video processors need torchvision, not
installed), so the test's subclass skips that one class check. Videos: the processor's own text
side expands `<video>` from the frame count of the pixels a stand-in video processor hands it (ours);
the pixels are checked against an independent computation: the clip decoded with PyAV directly,
the frames transformers' `default_sample_indices_fn` picks, each resized, rescaled and normalized
by transformers' numpy image transforms (PIL bicubic). The model side (core's
`LlavaOnevisionVision`) takes the samples' tiles, sizes and image counts (and videos) and gives
one feature per pad token.
"""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from loongforge.core.data.text import IGNORE
from loongforge.core.errors import UserError
from loongforge.core.foundation.llava_onevision import LlavaOnevisionConfig, LlavaOnevisionVision, image_token_count, video_token_count
from loongforge.core.foundation.mrope import IMAGE as IMAGE_TYPE
from loongforge.core.foundation.mrope import VIDEO as VIDEO_TYPE
from loongforge.core.foundation.siglip import SiglipVisionConfig
from loongforge.vlm.data import TINY_LLAVA_TOKENIZER, LlavaSampleEncoder, VisionRecord, encode_all, read_records, write_demo_dataset
from PIL import Image
from test_vlm_data import write_video
from transformers.models.llava_onevision.modeling_llava_onevision import image_size_to_num_patches

ROOT = Path(__file__).resolve().parents[2]
LLAVA_SPECIAL = ["<|im_start|>", "<|im_end|>", "<image>", "<video>"]
# 28-pixel tiles of 4 x 4 patches (16 tokens a tile), grids of at most 2 x 2 tiles
PINPOINTS = [[28, 28], [28, 56], [56, 28], [56, 56]]
# (30, 100): a 1 x 2 grid whose padding rows are cut; (100, 30): 2 x 1, padding columns cut; (50, 60): 2 x 2
SIZES = [(30, 100), (100, 30), (50, 60)]


def config(**kw) -> LlavaOnevisionConfig:
    vision = SiglipVisionConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, image_size=28, patch_size=7)
    return LlavaOnevisionConfig(vision_config=vision, text_hidden_size=24, image_grid_pinpoints=PINPOINTS, **kw)


CFG = config()


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TINY_LLAVA_TOKENIZER))


class VideoOutputs:
    """Stands in for `LlavaOnevisionVideoProcessor` (it needs torchvision): hands back the outputs
    set on it; the processor's text side counts each video's frames in them."""

    def __init__(self):
        self.outputs = {}

    def __call__(self, videos, **kwargs):
        from transformers import BatchFeature

        return BatchFeature(self.outputs)


def hf_processor(tok, cfg: LlavaOnevisionConfig, video_processor=None):
    """transformers' LlavaOnevisionProcessor for `cfg` (see the module docstring)."""
    import transformers

    class ImageOnlyProcessor(transformers.LlavaOnevisionProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor":
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    size = cfg.vision_config.image_size
    images = transformers.LlavaOnevisionImageProcessorPil(
        size={"height": size, "width": size}, image_grid_pinpoints=cfg.image_grid_pinpoints, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )
    return ImageOnlyProcessor(
        image_processor=images,
        video_processor=video_processor,
        tokenizer=tok,
        num_image_tokens=cfg.tile_side**2,
        vision_feature_select_strategy=cfg.vision_feature_select_strategy,
        vision_aspect_ratio=cfg.vision_aspect_ratio,
    )


def noise(height: int, width: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def trained_text(tok, sample: dict) -> str:
    return tok.decode([t for t, lab in zip(sample["input_ids"].tolist(), sample["labels"].tolist()) if lab != IGNORE])


def user(*parts) -> dict:
    return {"role": "user", "content": [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts]}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


IMAGE = {"type": "image"}
VIDEO = {"type": "video"}


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> Path:
    """20 frames at 8 fps, 56 x 56: a white square moving 2 pixels right a frame (test_vlm_data's)."""
    return write_video(tmp_path_factory.mktemp("video") / "clip.mp4", frames=20, fps=8)


def pyav_frames(path) -> np.ndarray:
    """Every frame of a video, decoded with PyAV directly: uint8 [F, H, W, 3]."""
    import av

    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def processed_frames(frames: np.ndarray, side: int) -> torch.Tensor:
    """uint8 frames -> [F, 3, side, side]: resized (PIL bicubic), rescaled by 1/255 and normalized
    with mean and std 0.5 by transformers' numpy image transforms (the PIL image processors' steps)."""
    from transformers.image_transforms import normalize, rescale, resize
    from transformers.image_utils import PILImageResampling

    out = [normalize(rescale(resize(f, (side, side), resample=PILImageResampling.BICUBIC), 1 / 255), [0.5] * 3, [0.5] * 3) for f in frames]
    return torch.from_numpy(np.stack(out)).permute(0, 3, 1, 2)


def test_tiny_llava_tokenizer_tokens_template_and_regeneration(tok, tmp_path):
    assert len(tok) == 498 and tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.bos_token is None
    ids = [tok.convert_tokens_to_ids(t) for t in LLAVA_SPECIAL]
    assert ids == list(range(494, 498))
    assert tok("a<image><video>b", add_special_tokens=False).input_ids[1:3] == ids[2:4]  # one token each
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        user("What is", IMAGE, "?"),
        assistant("red"),
        user({"type": "video"}, "And this?"),
        assistant("blue"),
    ]
    # LLaVA-OneVision's template: a message's images first, then its videos, then its text
    assert tok.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n<image>\nWhat is?<|im_end|>\n"
        "<|im_start|>assistant\nred<|im_end|>\n"
        "<|im_start|>user\n<video>\nAnd this?<|im_end|>\n"
        "<|im_start|>assistant\nblue<|im_end|>\n"
    )
    assert tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True).endswith("<|im_end|>\n<|im_start|>assistant\n")
    # string contents render as nothing under this template (HF's apply_chat_template leaves them as they are too)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<|im_start|>user\n<|im_end|>\n"
    # the shipped files are what tools/make_vlm_tiny_tokenizer.py writes, the Qwen tokenizer's unchanged
    spec = importlib.util.spec_from_file_location("make_vlm_tiny_tokenizer", ROOT / "tools" / "make_vlm_tiny_tokenizer.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.OUT = tmp_path / "tiny_tokenizer"
    script.main()
    for shipped, written in (
        (TINY_LLAVA_TOKENIZER.parent / "tiny_tokenizer", script.OUT),
        (TINY_LLAVA_TOKENIZER, tmp_path / script.LLAVA_NAME),
    ):
        names = sorted(p.name for p in shipped.iterdir())
        assert names == sorted(p.name for p in written.iterdir()) and "tokenizer.json" in names
        for name in names:
            assert (written / name).read_bytes() == (shipped / name).read_bytes(), (shipped, name)


def _records() -> list[tuple[str, VisionRecord]]:
    return [
        ("one image", VisionRecord([user(IMAGE, "\nWhat color is it?"), assistant("red")], images=[noise(*SIZES[0], seed=0)])),
        ("one tall image", VisionRecord([user("Describe", IMAGE), assistant("a cat")], images=[noise(*SIZES[1], seed=1)])),
        (
            "two images",
            VisionRecord(
                [user("Compare", IMAGE, "and", IMAGE), assistant("same"), user("Sure?"), assistant("yes")],
                images=[noise(*SIZES[2], seed=2), noise(*SIZES[0], seed=3)],
            ),
        ),
        ("text only", VisionRecord([user("What is one plus one?"), assistant("two")])),
    ]


@pytest.mark.parametrize("aspect", ["anyres_max_9", "anyres_max_1"])  # anyres_max_1 shrinks the 2 x 2 grid's map
def test_samples_match_llava_onevision_processor(tok, aspect):
    cfg = config(vision_aspect_ratio=aspect)
    enc = LlavaSampleEncoder(tok, cfg, max_length=1024)
    proc = hf_processor(tok, cfg)
    image_id = tok.convert_tokens_to_ids("<image>")
    answers = {"one image": "red", "one tall image": "a cat", "two images": "sameyes", "text only": "two"}
    for name, record in _records():
        for generation in (False, True):
            sample = enc.prompt(record) if generation else enc.encode(record)
            text = tok.apply_chat_template(record.messages, tokenize=False, add_generation_prompt=generation)
            n = len(record.images)
            want = proc(text=[text], images=[record.images] if n else None, return_tensors="pt")
            assert torch.equal(sample["input_ids"], want["input_ids"][0]), (name, generation)
            ids = sample["input_ids"]
            assert sample["mm_token_type_ids"].tolist() == (ids == image_id).long().tolist()
            assert torch.equal(sample["position_ids"], torch.arange(len(ids)).expand(3, -1))
            assert sample["position_ids"].dtype == torch.long and sample["position_ids"].shape == (3, len(ids))
            for key in ("image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts"):
                assert sample[key] is None
            if generation:
                assert (sample["labels"] == IGNORE).all() and text.endswith("<|im_start|>assistant\n")
            else:  # the loss on the assistant's text alone (the template's {% generation %} blocks)
                assert trained_text(tok, sample) == answers[name], name
            if not n:
                assert sample["pixel_values"] is None and sample["image_sizes"] is None and sample["batch_num_images"] is None
                assert "pixel_values" not in want
                continue
            # HF pads every image to the most tiles of the batch (its model cuts them by its own count); ours are back to back
            counts = [1 if n > 1 else image_size_to_num_patches(s, cfg.image_grid_pinpoints, 28) for s in want["image_sizes"].tolist()]
            tiles = torch.cat([p[:k] for p, k in zip(want["pixel_values"], counts)])
            assert all((p[k:] == 0).all() for p, k in zip(want["pixel_values"], counts))
            assert sample["pixel_values"].dtype == torch.float32
            assert torch.equal(sample["pixel_values"], tiles), name
            assert torch.equal(sample["image_sizes"], want["image_sizes"]) and sample["image_sizes"].dtype == torch.long
            assert sample["image_sizes"].tolist() == [[im.height, im.width] for im in record.images]
            assert torch.equal(sample["batch_num_images"], want["batch_num_images"]) and sample["batch_num_images"].tolist() == [n]
            # the pads of each image: image_token_count's (one tile, 16 + 1, for each of several images)
            runs = [len(r) for r in "".join("x" if t == image_id else " " for t in ids.tolist()).split()]
            counts = [image_token_count(cfg, im.height, im.width, multi_image=n > 1) for im in record.images]
            assert runs == counts, name
            if n > 1:
                assert counts == [cfg.tile_side**2 + 1] * n and len(sample["pixel_values"]) == n


def test_model_takes_the_samples(tok):
    """Core's LLaVA-OneVision vision side takes a pack's samples as they come (tiles back to back,
    sizes, image counts concatenated) and gives one feature per image pad."""
    enc = LlavaSampleEncoder(tok, CFG, max_length=1024)
    samples = [enc.encode(r) for _, r in _records()]
    image_id = tok.convert_tokens_to_ids("<image>")
    cat = {k: torch.cat([s[k] for s in samples if s[k] is not None]) for k in ("pixel_values", "image_sizes", "batch_num_images")}
    assert cat["batch_num_images"].tolist() == [1, 1, 2]
    torch.manual_seed(0)
    with torch.no_grad():
        features = LlavaOnevisionVision(CFG).eval()(cat["pixel_values"], cat["image_sizes"], cat["batch_num_images"])
    assert features.shape == (sum(int((s["input_ids"] == image_id).sum()) for s in samples), CFG.text_hidden_size)


def test_video_sample_matches_processor_and_frames(tok, clip):
    """An image and a video: the ids are the processor's (each `<video>` its frames' pooled patches
    plus a newline: 8 * 2 * 2 + 1 at 4 x 4 patches a tile), the video's pixels the 8 frames
    transformers samples of the PyAV-decoded clip, processed as the video processor does; the pads
    are typed and not trained on; the model gives one feature per video pad."""
    from transformers.video_utils import VideoMetadata, default_sample_indices_fn

    enc = LlavaSampleEncoder(tok, CFG, max_length=1024)
    assert enc.video_frames == 8
    record = VisionRecord([user(IMAGE, VIDEO, "What moves?"), assistant("a square")], images=[noise(*SIZES[0], seed=4)], videos=[str(clip)])
    sample = enc.encode(record)
    frames = pyav_frames(clip)
    index = default_sample_indices_fn(VideoMetadata(total_num_frames=len(frames), fps=8.0), num_frames=8)
    assert len(frames) == 20 and index.tolist() == [0, 2, 5, 7, 10, 12, 15, 17]
    want = processed_frames(frames[index], 28)[None]
    videos = sample["pixel_values_videos"]
    assert videos.dtype == torch.float32 and videos.shape == want.shape == (1, 8, 3, 28, 28)
    assert (videos - want).abs().max() < 1e-6  # fused rescale-normalize vs the two steps: float rounding
    shifted = processed_frames(frames[index + 1], 28)[None]  # the next frames (the square 2 pixels on) differ
    assert (shifted - want).abs().amax(dim=(0, 2, 3, 4)).min() > 0.1
    # the processor's text side, given these pixels, expands <video> as we do
    proc = hf_processor(tok, CFG, VideoOutputs())
    proc.video_processor.outputs = {"pixel_values_videos": videos}
    text = tok.apply_chat_template(record.messages, tokenize=False)
    hf = proc(text=[text], images=[record.images], videos=[np.zeros((8, 56, 56, 3), np.uint8)], return_tensors="pt")
    assert torch.equal(sample["input_ids"], hf["input_ids"][0])
    assert torch.equal(sample["pixel_values"], hf["pixel_values"][0, : len(sample["pixel_values"])])
    video_id, image_id = tok.convert_tokens_to_ids("<video>"), tok.convert_tokens_to_ids("<image>")
    ids = sample["input_ids"]
    count = video_token_count(CFG, 8)
    assert count == 8 * 2 * 2 + 1 == int((ids == video_id).sum())
    runs = [len(r) for r in "".join("v" if t == video_id else " " for t in ids.tolist()).split()]
    assert runs == [count]
    types = sample["mm_token_type_ids"]
    assert torch.equal(types, (ids == image_id).long() * IMAGE_TYPE + (ids == video_id).long() * VIDEO_TYPE)
    assert (sample["labels"][ids == video_id] == IGNORE).all() and trained_text(tok, sample) == "a square"
    assert sample["batch_num_images"].tolist() == [1] and sample["image_sizes"].tolist() == [list(SIZES[0])]
    assert torch.equal(sample["position_ids"], torch.arange(len(ids)).expand(3, -1))
    # the prompt side (generation) expands the same
    assert torch.equal(enc.prompt(VisionRecord(record.messages[:1], record.images, record.videos))["pixel_values_videos"], videos)
    torch.manual_seed(0)
    with torch.no_grad():
        features = LlavaOnevisionVision(CFG).eval().video_features(videos)
    assert features.shape == (count, CFG.text_hidden_size)
    # a clip of fewer frames than asked for repeats frames (transformers refuses it): 20 frames, 32 asked
    long = LlavaSampleEncoder(tok, CFG, max_length=1024, video_frames=32).encode(record)
    assert long["pixel_values_videos"].shape == (1, 32, 3, 28, 28)
    assert (long["pixel_values_videos"] - processed_frames(frames[np.arange(32) * 20 // 32], 28)[None]).abs().max() < 1e-6
    assert int((long["input_ids"] == video_id).sum()) == video_token_count(CFG, 32) == 32 * 4 + 1


def test_demo_and_llava_json_records_render(tok, tmp_path):
    """The demo writer's rows (LLaVA JSON, "<image>\\n" before the question) read into typed parts
    that this template renders: `<image>\\n` then the text (its own newline kept: "\\n\\n")."""
    root = write_demo_dataset(tmp_path / "demo", samples=8, seed=0)
    records = list(read_records(root / "data.json"))
    enc = LlavaSampleEncoder(tok, CFG, max_length=1024)
    samples, bad = encode_all(records, enc, progress=False)
    assert not bad and len(samples) == 8
    rows = json.loads((root / "data.json").read_text())
    for row, record, sample in zip(rows, records, samples):
        text = tok.apply_chat_template(record.messages, tokenize=False)
        question, answer = row["conversations"][0]["value"], row["conversations"][1]["value"]
        if "image" in row:
            assert text.startswith("<|im_start|>user\n<image>\n\n" + question.removeprefix("<image>\n") + "<|im_end|>\n")
            assert sample["batch_num_images"].tolist() == [1]
        else:
            assert text.startswith("<|im_start|>user\n" + question + "<|im_end|>\n") and sample["pixel_values"] is None
        assert trained_text(tok, sample).startswith(answer)


def test_bad_samples(tok, tmp_path, clip):
    noise(56, 56, seed=0).save(tmp_path / "good.png")
    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not an image")
    (tmp_path / "corrupt.mp4").write_bytes(b"not a video")
    (tmp_path / "clip.mp4").write_bytes(clip.read_bytes())

    def row(image=None, human="<image>\nWhat color?", answer="red", **extra):
        r = {"conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": answer}], **extra}
        if image is not None:
            r["image"] = image
        return r

    rows = [
        row("good.png"),  # 88 image tokens (a 2 x 2 grid: 16 + 8 x 8 + 8)
        row("corrupt.png"),
        row("missing.png"),
        row(None, human="<video>\nWhat happens?", video="corrupt.mp4"),
        row(None, human="<video>\nWhat happens?", video="missing.mp4"),
        row(None, human="<video>\nWhat moves?", answer="a square", video="clip.mp4"),  # 8 * 4 + 1 video tokens
        row("good.png", answer="red " * 30),  # over max_length once the pads are expanded
        row(None, human="What color?", answer="red " * 200),  # the text alone over max_length
        row("good.png", answer="blue"),
    ]
    (tmp_path / "data.json").write_text(json.dumps(rows))
    enc = LlavaSampleEncoder(tok, CFG, max_length=140)
    samples, bad = encode_all(read_records(tmp_path / "data.json"), enc, progress=False)
    assert bad == Counter(corrupt_media=2, missing_media=2, over_long=2)
    assert [trained_text(tok, s) for s in samples] == ["red", "a square", "blue"]
    assert samples[1]["pixel_values_videos"].shape == (1, 8, 3, 28, 28) and samples[1]["pixel_values"] is None
    # the template rendered another number of <image> (<video>) than the record has images (videos)
    video = str(tmp_path / "clip.mp4")
    mismatched = [
        VisionRecord([user(IMAGE, "Two?"), assistant("no")], images=[noise(30, 30, 0), noise(30, 30, 1)]),
        VisionRecord([user("<video> here?"), assistant("no")]),  # a <video> typed in the text, no video
        VisionRecord([user("What moves?"), assistant("no")], videos=[video]),  # a video with no <video>
        VisionRecord([user(VIDEO, VIDEO, "Two?"), assistant("no")], videos=[video]),
    ]
    for record in mismatched:
        with pytest.raises(Exception) as e:
            enc.encode(record)
        assert getattr(e.value, "reason", None) == "placeholder_mismatch"
    for source, reason in ((str(tmp_path / "corrupt.mp4"), "corrupt_media"), (str(tmp_path / "gone.mp4"), "missing_media")):
        with pytest.raises(Exception) as e:
            enc.prompt(VisionRecord([user(VIDEO, "?")], videos=[source]))
        assert getattr(e.value, "reason", None) == reason
    for frames in (0, 2.5, True):
        with pytest.raises(UserError, match="video_frames"):
            LlavaSampleEncoder(tok, CFG, video_frames=frames)
    with pytest.raises(UserError, match="has no <\\|image_pad\\|> token"):
        LlavaSampleEncoder(tok, CFG, image_token="<|image_pad|>")
    with pytest.raises(UserError, match="unknown keys"):
        LlavaSampleEncoder(tok, CFG, image_processing={"size": 384})
    # 'default' drops each tile's first patch: an anyres (one-image) sample can't be laid out (HF fails too)
    default = LlavaSampleEncoder(tok, config(vision_feature_select_strategy="default"), max_length=1024)
    assert default.encode(_records()[2][1])["input_ids"].eq(496).sum() == 2 * 16
    with pytest.raises(UserError, match="SigLIP has no CLS token"):
        default.encode(_records()[0][1])
    with pytest.raises(UserError, match="videos need 'full'"):
        default.encode(VisionRecord([user(VIDEO, "?"), assistant("no")], videos=[video]))


def test_videos_pack_and_prepack(tok, tmp_path, clip):
    """The recipe's encoder takes `data.image.video_frames`; packs stack their samples' videos
    ([videos, frames, 3, S, S]), the cost model counts each frame as a tile; a prepacked directory
    holds the same packs and is refused under another frame count."""
    from loongforge.core.recipes import resolve
    from loongforge.vlm.config import ImageConfig
    from loongforge.vlm.data.llava import LLAVA_OV_VIDEO_FRAMES
    from loongforge.vlm.prepacked import PrepackedVisionPacks, write_prepacked
    from loongforge.vlm.recipe import encoded_samples, pack_all, prepare_for_packing, sample_encoder, sample_sizes

    assert ImageConfig().video_frames == LLAVA_OV_VIDEO_FRAMES == 8
    noise(56, 56, seed=0).save(tmp_path / "good.png")
    (tmp_path / "clip.mp4").write_bytes(clip.read_bytes())
    rows = [
        {"video": "clip.mp4", "conversations": [{"from": "human", "value": "<video>\nWhat moves?"}, {"from": "gpt", "value": "a square"}]},
        {"image": "good.png", "conversations": [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "noise"}]},
        {"video": "clip.mp4", "conversations": [{"from": "human", "value": "<video>\nWhere?"}, {"from": "gpt", "value": "right"}]},
    ]
    (tmp_path / "data.json").write_text(json.dumps(rows))
    overrides = [f"data.paths=[{tmp_path / 'data.json'}]", "data.seq_length=256", "data.image.video_frames=4"]
    _, cfg = resolve("llava_onevision_tiny", overrides, prefer="vlm")
    cfg, ptok = prepare_for_packing(cfg)
    assert sample_encoder(cfg.model, ptok, {}, 64).video_frames == 8  # a run written before the field: the default
    samples, bad = encoded_samples(cfg, ptok, tmp_path / "run")
    assert (
        not bad
        and [tuple(s["pixel_values_videos"].shape) for s in samples if s["pixel_values_videos"] is not None] == [(1, 4, 3, 28, 28)] * 2
    )
    tile = cfg.model.tower.tile_side**2
    assert sample_sizes(samples[0], cfg.model) == [len(samples[0]["tokens"]), [tile] * 4]  # the frames
    assert sample_sizes(samples[1], cfg.model)[1] == [tile] * len(samples[1]["pixel_values"])  # the image's tiles
    packs, _, _ = pack_all(cfg, samples)
    assert len(packs) == 1 and packs[0]["pixel_values_videos"].shape == (2, 4, 3, 28, 28)
    assert torch.equal(
        packs[0]["pixel_values_videos"], torch.cat([s["pixel_values_videos"] for s in samples if s["pixel_values_videos"] is not None])
    )
    write_prepacked(cfg, ptok, tmp_path / "packs")
    back = PrepackedVisionPacks(tmp_path / "packs", cfg, ptok)
    assert back.meta["processor.video_frames"] == 4
    assert all(torch.equal(back[0][k], packs[0][k]) for k in ("tokens", "pixel_values_videos", "pixel_values", "image_sizes"))
    _, other = resolve("llava_onevision_tiny", [*overrides[:-1], "data.image.video_frames=8"], prefer="vlm")
    other, _ = prepare_for_packing(other)
    with pytest.raises(UserError, match="processor.video_frames=4, this run has 8"):
        PrepackedVisionPacks(tmp_path / "packs", other, ptok)
    meta = json.loads((tmp_path / "packs" / "loongforge_vlm.json").read_text())
    del meta["processor.video_frames"]  # a directory written before the frame count was recorded
    (tmp_path / "packs" / "loongforge_vlm.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match="processor.video_frames=None, this run has 4"):
        PrepackedVisionPacks(tmp_path / "packs", cfg, ptok)


def test_from_hf_directory(tok, tmp_path):
    cfg = config(vision_aspect_ratio="anyres_max_4")
    (tmp_path / "config.json").write_text(json.dumps({**cfg.hf_config(), "model_type": "llava_onevision"}))
    size = cfg.vision_config.image_size
    pre = {
        "image_processor_type": "LlavaOnevisionImageProcessor",
        "image_grid_pinpoints": PINPOINTS,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "resample": 3,
        "rescale_factor": 1 / 255,
        "size": {"height": size, "width": size},
    }
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(pre))
    enc = LlavaSampleEncoder.from_hf(tok, tmp_path, max_length=512)
    assert enc.cfg == cfg and enc.max_length == 512
    record = _records()[0][1]
    want = LlavaSampleEncoder(tok, cfg, max_length=512).encode(record)
    got = enc.encode(record)
    assert all(torch.equal(got[k], want[k]) for k in ("input_ids", "labels", "pixel_values", "image_sizes"))
    # another normalization is taken from the file
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**pre, "image_mean": [0.2, 0.3, 0.4]}))
    assert not torch.equal(LlavaSampleEncoder.from_hf(tok, tmp_path).encode(record)["pixel_values"], want["pixel_values"])
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**pre, "image_grid_pinpoints": [[28, 28]]}))
    with pytest.raises(UserError, match="image_grid_pinpoints differ"):
        LlavaSampleEncoder.from_hf(tok, tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**pre, "size": {"height": 384, "width": 384}}))
    with pytest.raises(UserError, match="not the tower's image_size 28"):
        LlavaSampleEncoder.from_hf(tok, tmp_path)
