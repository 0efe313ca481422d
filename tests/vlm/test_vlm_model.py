"""The composed Qwen2.5-VL model against HF transformers' `Qwen2_5_VLForConditionalGeneration`
(the oracle) on a tiny random config: fp32 logits within 1e-5 relative on a batch of a sample
with two images of different sizes, a text-only sample and a sample with a two-frame video (HF
pads the batch; ours packs it); HF -> LoongForge -> HF every tensor bit-identical; 8 greedy
tokens equal HF `generate`."""

import dataclasses
import json

import pytest
import torch
from loongforge.core.errors import UserError
from loongforge.core.foundation.families import QWEN2
from loongforge.core.parallel import init_parallel
from loongforge.vlm.model import VisionLanguageModel, read_hf_config
from vlm_oracle import assert_round_trip, load_pair, save_perturbed

VOCAB, IMG, VID, START, END = 96, 90, 91, 92, 93
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]},
)
VISION = dict(
    depth=2, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4, window_size=16, out_hidden_size=32, fullatt_block_indexes=[1]
)


def ctx():
    return init_parallel(1, 1, "gloo", "cpu")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    cfg = Qwen2_5_VLConfig(
        text_config=TEXT,
        vision_config={**VISION, "tokens_per_second": 2},
        image_token_id=IMG,
        video_token_id=VID,
        vision_start_token_id=START,
        vision_end_token_id=END,
    )
    return save_perturbed(Qwen2_5_VLForConditionalGeneration, cfg, tmp_path_factory.mktemp("hf") / "qwen25vl")


def sample(text, *items):
    """ids: text tokens, then per item (kind, merged tokens) a start, that many pads, an end, text."""
    g = torch.Generator().manual_seed(len(items) * 7 + text)
    ids = torch.randint(0, 80, (text,), generator=g).tolist()
    for pad, n in items:
        ids += [START] + [pad] * n + [END] + torch.randint(0, 80, (3,), generator=g).tolist()
    return ids


def batch():
    """Two images (8x12 and 4x4 patches) in one sample, a text-only sample, a 2-frame video."""
    grids = torch.tensor([[1, 8, 12], [1, 4, 4]])
    vgrid = torch.tensor([[2, 4, 8]])
    rows = [sample(5, (IMG, 24), (IMG, 4)), sample(9), sample(4, (VID, 16))]
    s = max(map(len, rows))
    ids = torch.tensor([r + [0] * (s - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (s - len(r)) for r in rows])
    g = torch.Generator().manual_seed(1)
    pix = torch.randn(int(grids.prod(1).sum()), 3 * 2 * 4 * 4, generator=g)
    vpix = torch.randn(int(vgrid.prod(1).sum()), 3 * 2 * 4 * 4, generator=g)
    types = torch.zeros_like(ids)
    types[ids == IMG], types[ids == VID] = 1, 2
    return dict(
        input_ids=ids,
        mm_token_type_ids=types,
        attention_mask=mask,
        pixel_values=pix,
        image_grid_thw=grids,
        pixel_values_videos=vpix,
        video_grid_thw=vgrid,
        second_per_grid_ts=torch.tensor([1.0]),
    )


@pytest.fixture(scope="module")
def pair(hf_dir):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return load_pair(Qwen2_5_VLForConditionalGeneration, hf_dir)


def test_logits_match_hf(pair):
    ref, ours = pair
    b = batch()
    with torch.no_grad():
        want = ref(**b).logits
    got = ours.hf_logits(**b)
    with torch.no_grad():
        assert torch.equal(ours(**b), got)  # called as HF's model is
    keep = b["attention_mask"].bool()
    for r in range(3):
        w, o = want[r][keep[r]], got[r][keep[r]]
        assert (o - w).abs().max() / w.abs().max() < 1e-5, r
    # negative control: 1-D positions (every M-RoPE row the same) change the image samples' logits
    ours.sections, saved = [sum(ours.sections), 0, 0], ours.sections
    try:
        flat = ours.hf_logits(**b)
    finally:
        ours.sections = saved
    assert (flat[0][keep[0]] - want[0][keep[0]]).abs().max() / want.abs().max() > 1e-3
    assert (flat[1][keep[1]] - want[1][keep[1]]).abs().max() / want.abs().max() < 1e-5  # text only: the same


def test_round_trip_bit_identical(pair, hf_dir, tmp_path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    assert_round_trip(Qwen2_5_VLForConditionalGeneration, *pair, hf_dir, tmp_path / "out", batch())


def test_greedy_generate_matches_hf(pair):
    ref, ours = pair
    b = batch()
    one = {
        "input_ids": b["input_ids"][:1, : int(b["attention_mask"][0].sum())],
        "mm_token_type_ids": b["mm_token_type_ids"][:1, : int(b["attention_mask"][0].sum())],
        "pixel_values": b["pixel_values"],
        "image_grid_thw": b["image_grid_thw"],
    }
    with torch.no_grad():
        want = ref.generate(**one, max_new_tokens=8, do_sample=False)
    got = ours.generate(one["input_ids"], 8, pixel_values=one["pixel_values"], image_grid_thw=one["image_grid_thw"])
    assert torch.equal(got, want)


def test_bad_configs(hf_dir, tmp_path):
    c = json.loads((hf_dir / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**c, "model_type": "llava"}))
    with pytest.raises(UserError, match="model_type 'llava' is not a supported VLM"):
        read_hf_config(bad, {"qwen2": QWEN2})
    fam, cfg = read_hf_config(hf_dir, {"qwen2": QWEN2})
    cfg = dataclasses.replace(cfg, vision={**cfg.vision, "out_hidden_size": 16})
    with pytest.raises(UserError, match="out_hidden_size=16 must equal model.language.hidden_size=32"):
        VisionLanguageModel.build(fam, cfg, ctx())


def test_vision_recompute_runs_blocks_again_in_backward(hf_dir):
    """vision_recompute: each ViT block runs twice per training step (forward, then again in
    backward) and gives the same gradients as without it."""
    from loongforge.core.foundation import hf_io
    from loongforge.core.foundation.hf_mapping import hf_to_lf
    from loongforge.vlm.model import vlm_table

    family, cfg = read_hf_config(hf_dir, {"qwen2": QWEN2})
    state = hf_io.load_hf_state(hf_dir)
    b = batch()
    grads, calls = [], []
    for recompute in (False, True):
        m = VisionLanguageModel.build(family, cfg, ctx(), vision_recompute=recompute)
        m.load_lf(hf_to_lf(vlm_table(family, cfg.arch), state, m.cfg))
        n = [0]
        m.vision.blocks[0].qkv.register_forward_hook(lambda *_: n.__setitem__(0, n[0] + 1))
        with torch.enable_grad():
            m.vision(b["pixel_values"], b["image_grid_thw"]).square().sum().backward()
        grads.append(m.vision.blocks[0].qkv.weight.grad.clone())
        calls.append(n[0])
    assert calls == [1, 2] and torch.allclose(grads[0], grads[1], rtol=1e-6, atol=1e-7)
