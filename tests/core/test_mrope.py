"""M-RoPE against HF transformers' Qwen2.5-VL: the three position rows of samples mixing text,
images and a video (HF's `get_rope_index`, padding included), and q / k rotated through op
`rotary` with `mrope_tables` equal to HF's multimodal rotary embedding."""

import pytest
import torch
from loongforge.core.foundation.mrope import IMAGE, TEXT, VIDEO, mrope_positions, mrope_tables
from loongforge.core.ops import reference as ref


@pytest.fixture(scope="module")
def hf_model():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLModel

    cfg = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=64, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64, tokens_per_second=2),
    )  # fmt: skip
    return Qwen2_5_VLModel(cfg).eval()


SAMPLES = [
    [TEXT] * 3 + [IMAGE] * 6 + [TEXT] * 2 + [VIDEO] * 8 + [TEXT],
    [TEXT] * 2 + [IMAGE] * 4 + [TEXT] * 3,
]
IMAGES = [(1, 4, 6), (1, 4, 4)]
VIDEOS = [(2, 4, 4)]
SECONDS = [1.5]


def test_positions_match_hf_get_rope_index(hf_model):
    length = max(len(s) for s in SAMPLES)
    types = torch.zeros(2, length, dtype=torch.long)
    mask = torch.zeros(2, length, dtype=torch.long)
    for b, s in enumerate(SAMPLES):  # the second sample left-padded
        types[b, length - len(s) :] = torch.tensor(s)
        mask[b, length - len(s) :] = 1
    want, _ = hf_model.get_rope_index(
        torch.ones(2, length, dtype=torch.long), types, torch.tensor(IMAGES), torch.tensor(VIDEOS), torch.tensor(SECONDS), mask
    )
    first = mrope_positions(SAMPLES[0], IMAGES[:1], VIDEOS, SECONDS)
    second = mrope_positions(SAMPLES[1], IMAGES[1:])
    assert torch.equal(first, want[:, 0, length - len(SAMPLES[0]) :])
    assert torch.equal(second, want[:, 1, length - len(SAMPLES[1]) :])
    assert first[0, 11:19].tolist() == [8] * 4 + [11] * 4  # the video's frames 1.5 s x 2 tokens/s apart
    with pytest.raises(ValueError, match="a run of 6 vision tokens at 3 for a grid of 4 merged patches"):
        mrope_positions(SAMPLES[0], [(1, 4, 4)], VIDEOS, SECONDS)


def test_rotation_matches_hf(hf_model):
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding, apply_rotary_pos_emb

    pos = mrope_positions(SAMPLES[0], IMAGES[:1], VIDEOS, SECONDS)
    rope = Qwen2_5_VLRotaryEmbedding(hf_model.config.text_config)
    q, k = torch.randn(1, 4, pos.shape[1], 16), torch.randn(1, 2, pos.shape[1], 16)
    cos, sin = rope(q, pos[:, None, :])
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    c, s = mrope_tables(pos, rope.inv_freq, (2, 3, 3))
    got_q, got_k = ref.rotary(q[0].transpose(0, 1), k[0].transpose(0, 1), c, s, False)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
