"""Qwen3-VL composed from core parts against HF transformers' `Qwen3VLForConditionalGeneration`
(the oracle) on a tiny random config: fp32 logits within 1e-5 relative on a batch of a sample with
two images of different sizes, a text-only sample and a sample with a video whose frames sit apart
(timestamps between them); DeepStack and interleaved M-RoPE each matter (negative controls);
HF -> LoongForge -> HF every tensor bit-identical and the export's logits equal HF's; 8 greedy
tokens equal HF `generate`; the shipped tiny Qwen3-VL config trains on the demo."""

import pytest
import torch
from conftest import losses
from loongforge.core.foundation.families import QWEN3
from vlm_oracle import assert_round_trip, load_pair, row_error, save_perturbed, train_demo

VOCAB, IMG, VID, START, END = 96, 90, 91, 92, 93
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "mrope_interleaved": True},
)
VISION = dict(
    depth=3,
    hidden_size=16,
    intermediate_size=32,
    num_heads=2,
    patch_size=4,
    out_hidden_size=32,
    num_position_embeddings=16,
    deepstack_visual_indexes=[0, 2],
)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    cfg = Qwen3VLConfig(
        text_config=TEXT, vision_config=VISION, image_token_id=IMG, video_token_id=VID, vision_start_token_id=START, vision_end_token_id=END
    )
    return save_perturbed(Qwen3VLForConditionalGeneration, cfg, tmp_path_factory.mktemp("hf") / "qwen3vl")


def sample(seed, text, *items):
    """ids: text tokens, then per item (pad, merged tokens) a start, that many pads, an end, text."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 80, (text,), generator=g).tolist()
    for pad, n in items:
        ids += [START] + [pad] * n + [END] + torch.randint(0, 80, (3,), generator=g).tolist()
    return ids


def batch():
    """Two images (8x12 and 4x4 patches) in one sample, a text-only sample, a 2-frame-group video
    (4x8 patches per group: two runs of 8 pad tokens with text between, as timestamps)."""
    grids = torch.tensor([[1, 8, 12], [1, 4, 4]])
    vgrid = torch.tensor([[2, 4, 8]])
    rows = [sample(1, 5, (IMG, 24), (IMG, 4)), sample(2, 9), sample(3, 4, (VID, 8), (VID, 8))]
    s = max(map(len, rows))
    ids = torch.tensor([r + [0] * (s - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (s - len(r)) for r in rows])
    g = torch.Generator().manual_seed(1)
    types = torch.zeros_like(ids)
    types[ids == IMG], types[ids == VID] = 1, 2
    return dict(
        input_ids=ids,
        mm_token_type_ids=types,
        attention_mask=mask,
        pixel_values=torch.randn(int(grids.prod(1).sum()), 3 * 2 * 4 * 4, generator=g),
        image_grid_thw=grids,
        pixel_values_videos=torch.randn(int(vgrid.prod(1).sum()), 3 * 2 * 4 * 4, generator=g),
        video_grid_thw=vgrid,
    )


@pytest.fixture(scope="module")
def pair(hf_dir):
    from transformers import Qwen3VLForConditionalGeneration

    return load_pair(Qwen3VLForConditionalGeneration, hf_dir)


def test_logits_match_hf(pair):
    ref, ours = pair
    assert ours.cfg.arch == "qwen3_vl" and ours.cfg.language.family == "qwen3" and ours.cfg.language.mrope_interleaved
    b = batch()
    with torch.no_grad():
        want = ref(**b).logits
    got = ours.hf_logits(**b)
    keep = b["attention_mask"].bool()
    for r in range(3):
        assert row_error(got, want, keep, r) < 1e-5, r


def test_deepstack_and_interleaving_matter(pair):
    """Negative controls: M-RoPE in sections instead of interleaved, and the DeepStack additions
    dropped, each change the image and video samples' logits (not the text-only one's)."""
    ref, ours = pair
    b = batch()
    keep = b["attention_mask"].bool()
    with torch.no_grad():
        want = ref(**b).logits
    ours.interleaved = False
    try:
        flat = ours.hf_logits(**b)
    finally:
        ours.interleaved = True
    assert row_error(flat, want, keep, 0) > 1e-3 and row_error(flat, want, keep, 2) > 1e-3 and row_error(flat, want, keep, 1) < 1e-5
    merger = ours.vision.deepstack_mergers[0].fc2
    saved = merger.weight.detach().clone(), merger.bias.detach().clone()
    with torch.no_grad():
        merger.weight.zero_(), merger.bias.zero_()
    try:
        shallow = ours.hf_logits(**b)
    finally:
        with torch.no_grad():
            merger.weight.copy_(saved[0]), merger.bias.copy_(saved[1])
    assert row_error(shallow, want, keep, 0) > 1e-3 and row_error(shallow, want, keep, 1) < 1e-5


def test_round_trip_bit_identical(pair, hf_dir, tmp_path):
    from transformers import Qwen3VLForConditionalGeneration

    assert_round_trip(Qwen3VLForConditionalGeneration, *pair, hf_dir, tmp_path / "out", batch())


def test_greedy_generate_matches_hf(pair):
    ref, ours = pair
    b = batch()
    n = int(b["attention_mask"][0].sum())
    one = {"input_ids": b["input_ids"][:1, :n], "mm_token_type_ids": b["mm_token_type_ids"][:1, :n]}
    with torch.no_grad():
        want = ref.generate(**one, pixel_values=b["pixel_values"], image_grid_thw=b["image_grid_thw"], max_new_tokens=8, do_sample=False)
    got = ours.generate(one["input_ids"], 8, pixel_values=b["pixel_values"], image_grid_thw=b["image_grid_thw"])
    assert torch.equal(got, want)


def test_demo_trains_as_qwen3_vl(tmp_path):
    """The shipped tiny Qwen3-VL config (its tower's DeepStack into the first layers, a Qwen3
    language model with interleaved M-RoPE) trains 12 steps on the demo and exports to HF."""
    train_demo("qwen3_vl_tiny", tmp_path)
    got = losses(tmp_path)
    assert got[12] < got[1], got
    assert (tmp_path / "hf" / "config.json").is_file()  # Qwen3-VL exports as Qwen3VLForConditionalGeneration


def test_processing_follows_the_arch():
    """Qwen3-VL's image normalization (mean / std 0.5), patch size and timestamped video prompts
    come from the model (tests/vlm/test_vlm_qwen3_video.py checks those prompts against HF's)."""
    from loongforge.vlm.model import VLMConfig
    from loongforge.vlm.recipe import processor_config

    _, cfg = qwen3_config(VISION)
    proc = processor_config(cfg, {})
    assert proc.image_mean == (0.5, 0.5, 0.5) and proc.image_std == (0.5, 0.5, 0.5) and proc.patch_size == 4 and proc.video_timestamps
    assert not processor_config(VLMConfig(), {}).video_timestamps  # Qwen2.5-VL's videos: one run of pads


def qwen3_config(vision: dict):
    from loongforge.core.foundation.qwen3_vl_vision import Qwen3VisionConfig
    from loongforge.core.foundation.spec import ModelConfig
    from loongforge.vlm.model import VLMConfig

    cfg = VLMConfig(arch="qwen3_vl", vision=vision, language=ModelConfig(family="qwen3", mrope_section=[2, 3, 3], mrope_interleaved=True))
    assert isinstance(cfg.tower, Qwen3VisionConfig)
    return QWEN3, cfg
