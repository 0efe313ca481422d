"""LLaVA-OneVision composed from core parts (SigLIP tower, GELU projector, anyres tiles with
unpadding and `image_newline`; a Qwen2 language model with 1-D positions) against HF
transformers' `LlavaOnevisionForConditionalGeneration` (the oracle) on a tiny random config: fp32
logits within 1e-5 relative on a batch of two images of different sizes (anyres tiles from HF's
image processor) and a text-only sample, and on a batch with videos (`pixel_values_videos`: each
frame's patch map pooled, a newline after each video) beside an image; HF -> LoongForge -> HF every
tensor bit-identical and the export's logits equal HF's; files with transformers 4 names load the
same; 8 greedy tokens equal HF `generate`; the shipped tiny config trains on images and videos,
exports and answers as HF does."""

import numpy as np
import pytest
import torch
from loongforge.core.foundation.llava_onevision import image_token_count, video_token_count
from loongforge.core.parallel import init_parallel
from loongforge.vlm.model import VisionLanguageModel
from vlm_oracle import FAMILIES, assert_round_trip, load_pair, row_error, save_tiny_llava_onevision, train_demo

VOCAB, IMG, VID = 96, 90, 91
PINPOINTS = [[28, 28], [28, 56], [56, 28], [56, 56]]
SIZES = [(30, 100), (50, 60)]  # a 1 x 2 grid with padding rows cut; a 2 x 2 grid


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_tiny_llava_onevision(tmp_path_factory.mktemp("hf") / "llava_ov", IMG, VID, VOCAB, PINPOINTS)


def batch(tower):
    """An image sample, a text-only sample, another image sample (right-padded)."""
    from PIL import Image
    from transformers import LlavaOnevisionImageProcessorPil

    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in SIZES]
    proc = LlavaOnevisionImageProcessorPil(size={"height": 28, "width": 28}, image_grid_pinpoints=PINPOINTS)
    px = proc(images, return_tensors="pt")
    g = torch.Generator().manual_seed(3)
    text = lambda n: torch.randint(0, 80, (n,), generator=g).tolist()  # noqa: E731
    rows = [
        text(4) + [IMG] * image_token_count(tower, *SIZES[0]) + text(5),
        text(9),
        text(3) + [IMG] * image_token_count(tower, *SIZES[1]) + text(2),
    ]
    s = max(map(len, rows))
    ids = torch.tensor([r + [0] * (s - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (s - len(r)) for r in rows])
    return dict(
        input_ids=ids,
        attention_mask=mask,
        pixel_values=px["pixel_values"],
        image_sizes=px["image_sizes"],
        batch_num_images=torch.tensor([1, 0, 1]),
    )


@pytest.fixture(scope="module")
def pair(hf_dir):
    from transformers import LlavaOnevisionForConditionalGeneration

    return load_pair(LlavaOnevisionForConditionalGeneration, hf_dir)


def test_logits_match_hf(pair):
    ref, ours = pair
    assert ours.cfg.arch == "llava_onevision" and ours.cfg.language.family == "qwen2" and ours.cfg.language.mrope_section is None
    b = batch(ours.cfg.tower)
    with torch.no_grad():
        want = ref(**b).logits
    got = ours.hf_logits(**b)
    keep = b["attention_mask"].bool()
    for r in range(3):
        assert row_error(got, want, keep, r) < 1e-5, r
    # negative control: without image_newline the image samples' logits change, the text's do not
    with torch.no_grad():
        saved = ours.vision.image_newline.detach().clone()
        ours.vision.image_newline.zero_()
    try:
        off = ours.hf_logits(**b)
    finally:
        with torch.no_grad():
            ours.vision.image_newline.copy_(saved)
    assert row_error(off, want, keep, 0) > 1e-3 and row_error(off, want, keep, 1) < 1e-5


def video_batch(tower, frames: int = 3):
    """A video sample, an image + video sample, a text-only sample (right-padded): two videos of
    `frames` frames as the processor gives them ([videos, frames, 3, S, S])."""
    from PIL import Image
    from transformers import LlavaOnevisionImageProcessorPil

    rng = np.random.default_rng(1)
    image = Image.fromarray(rng.integers(0, 256, (*SIZES[0], 3), dtype=np.uint8))
    px = LlavaOnevisionImageProcessorPil(size={"height": 28, "width": 28}, image_grid_pinpoints=PINPOINTS)([image], return_tensors="pt")
    g = torch.Generator().manual_seed(4)
    text = lambda n: torch.randint(0, 80, (n,), generator=g).tolist()  # noqa: E731
    video = [VID] * video_token_count(tower, frames)
    rows = [text(3) + video + text(4), text(2) + [IMG] * image_token_count(tower, *SIZES[0]) + video + text(3), text(7)]
    s = max(map(len, rows))
    return dict(
        input_ids=torch.tensor([r + [0] * (s - len(r)) for r in rows]),
        attention_mask=torch.tensor([[1] * len(r) + [0] * (s - len(r)) for r in rows]),
        pixel_values=px["pixel_values"],
        image_sizes=px["image_sizes"],
        batch_num_images=torch.tensor([0, 1, 0]),
        pixel_values_videos=torch.randn(2, frames, 3, 28, 28, generator=g),
    )


def test_video_logits_match_hf(pair):
    """Videos (HF `get_video_features`: frames through the tower, pooled to half the patch map's
    side, a newline after each video) beside an image and a text-only row; our model called as HF's
    is (`model(**inputs)`)."""
    ref, ours = pair
    b = video_batch(ours.cfg.tower)
    assert video_token_count(ours.cfg.tower, 3) == 3 * 2 * 2 + 1  # 4 x 4 patches a frame, pooled to 2 x 2
    with torch.no_grad():
        want = ref(**b).logits
        got = ours(**b)
    keep = b["attention_mask"].bool()
    for r in range(3):
        assert row_error(got, want, keep, r) < 1e-5, r
    # negative control: the frames in another order change the video rows' logits, not the text row's
    off = ours(**{**b, "pixel_values_videos": b["pixel_values_videos"].flip(1)})
    assert row_error(off, want, keep, 0) > 1e-3 and row_error(off, want, keep, 2) < 1e-5


def test_round_trip_bit_identical(pair, hf_dir, tmp_path):
    from transformers import LlavaOnevisionForConditionalGeneration

    assert_round_trip(LlavaOnevisionForConditionalGeneration, *pair, hf_dir, tmp_path / "out", batch(pair[1].cfg.tower))


def test_transformers_4_names_load(pair, hf_dir, tmp_path):
    """The llava-hf checkpoints' names (`vision_tower.vision_model.*`) give the same model."""
    import shutil

    from safetensors.torch import load_file, save_file

    _, ours = pair
    old = tmp_path / "old"
    shutil.copytree(hf_dir, old)
    state = load_file(str(old / "model.safetensors"))
    renamed = {
        ("vision_tower.vision_model." + k.removeprefix("vision_tower.") if k.startswith("vision_tower.") else k): v
        for k, v in state.items()
    }
    save_file(renamed, str(old / "model.safetensors"), metadata={"format": "pt"})
    again = VisionLanguageModel.from_hf(old, FAMILIES, init_parallel(1, 1, "gloo", "cpu"))
    mine, theirs = again.lf_state(), ours.lf_state()
    assert set(mine) == set(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_greedy_generate_matches_hf(pair):
    ref, ours = pair
    b = batch(ours.cfg.tower)
    n = int(b["attention_mask"][0].sum())
    one = {"input_ids": b["input_ids"][:1, :n], "pixel_values": b["pixel_values"][:1], "image_sizes": b["image_sizes"][:1]}
    with torch.no_grad():
        want = ref.generate(**one, max_new_tokens=8, do_sample=False)
    got = ours.generate(one["input_ids"], 8, pixel_values=one["pixel_values"], image_sizes=one["image_sizes"])
    assert torch.equal(got, want)


def test_demo_trains_exports_and_generates(tmp_path):
    """The shipped tiny LLaVA-OneVision config trains 12 steps on the demo shapes plus 8 video
    samples (its chat template, anyres tiles, 6 frames a video: 6 * 1 + 1 video tokens at 2 x 2
    patches a tile), none skipped; the HF export loads in transformers and gives `load_model`'s
    logits on a prompt with an image and on one with a video; `generate` on the run answers with HF
    `generate`'s tokens."""
    import json

    from conftest import losses
    from loongforge.core.data.text import load_tokenizer
    from loongforge.vlm import load_model
    from loongforge.vlm.data import LlavaSampleEncoder, VisionRecord, read_records, write_demo_dataset
    from loongforge.vlm.generate import answer
    from test_vlm_data import write_video
    from transformers import LlavaOnevisionForConditionalGeneration

    data = write_demo_dataset(tmp_path / "data", samples=48, seed=0)
    write_video(data / "clip.mp4", frames=12, fps=8)  # a square moving right
    rows = json.loads((data / "data.json").read_text())
    ask = [{"from": "human", "value": "<video>\nWhich way does the square move?"}, {"from": "gpt", "value": "right"}]
    rows += [{"id": f"video{i}", "video": "clip.mp4", "conversations": ask} for i in range(8)]
    (data / "data.json").write_text(json.dumps(rows))
    run = tmp_path / "run"
    r = train_demo("llava_onevision_tiny", run, f"data.paths=[{data / 'data.json'}]", "data.image.video_frames=6")
    assert "vlm data: 56 samples" in r.stdout and "skipped" not in r.stdout + r.stderr, r.stdout[-2000:]
    got = losses(run)
    assert got[12] < got[1], got
    ours = load_model(run)
    ref = LlavaOnevisionForConditionalGeneration.from_pretrained(str(run / "hf"), dtype=torch.float32).eval()
    tok = load_tokenizer(str(run / "tokenizer"))
    records = list(read_records([str(data / "data.json")]))
    record = records[0]
    enc = LlavaSampleEncoder(tok, ours.cfg.tower, video_frames=6)
    x = enc.prompt(VisionRecord(records[-1].messages[:1], videos=records[-1].videos))
    assert x["pixel_values_videos"].shape == (1, 6, 3, 28, 28)
    inputs = dict(input_ids=x["input_ids"][None], pixel_values_videos=x["pixel_values_videos"])
    with torch.no_grad():
        want = ref(**inputs).logits
    assert float((ours.hf_logits(**inputs) - want).abs().max() / want.abs().max()) < 1e-5
    x = enc.prompt(VisionRecord(record.messages[:1], images=record.images))
    inputs = dict(input_ids=x["input_ids"][None], pixel_values=x["pixel_values"][None], image_sizes=x["image_sizes"])
    with torch.no_grad():
        want = ref(**inputs).logits
        hf_tokens = ref.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert float((ours.hf_logits(**inputs) - want).abs().max() / want.abs().max()) < 1e-5
    image = record.images[0]
    prompt = next(p["text"] for p in record.messages[0]["content"] if p.get("type") == "text")
    assert (
        answer(run, prompt, [image], max_new_tokens=4)
        == tok.decode(hf_tokens[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()
    )
