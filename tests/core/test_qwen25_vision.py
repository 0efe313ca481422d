"""Qwen2.5-VL's vision tower in core's foundation against HF transformers' (the oracle) on a tiny
random config: merged features within 1e-5 relative (fp32, CPU) for packed images and a 2-frame
video of different sizes, windows padded at the edges, windowed and full-attention layers; HF ->
LoongForge -> HF every tensor bit-identical."""

import pytest
import torch
from conftest import perturbed
from loongforge.core.errors import UserError
from loongforge.core.foundation.hf_mapping import hf_to_lf, lf_to_hf
from loongforge.core.foundation.qwen2_5_vl_vision import QWEN25_VISION_TABLE, Qwen25VisionConfig, Qwen25VisionTower

CFG = Qwen25VisionConfig(
    depth=3, hidden_size=32, intermediate_size=48, num_heads=4, patch_size=4, window_size=16, out_hidden_size=24, fullatt_block_indexes=[1]
)


@pytest.fixture(scope="module")
def pair():
    from transformers import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    hc = Qwen2_5_VLVisionConfig(**CFG.hf_config())
    hc._attn_implementation = "sdpa"
    ref = perturbed(lambda: Qwen2_5_VisionTransformerPretrainedModel(hc))
    ours = Qwen25VisionTower(CFG).eval()
    ours.load_state_dict(hf_to_lf(QWEN25_VISION_TABLE, ref.state_dict(), CFG), strict=True)
    return ref, ours


@pytest.mark.parametrize("grid", [[[1, 12, 20], [2, 8, 6]], [[1, 10, 14], [1, 4, 4], [1, 6, 2]]])
def test_features_match_hf(pair, grid):
    ref, ours = pair
    grid = torch.tensor(grid)
    x = torch.randn(int(grid.prod(1).sum()), CFG.patch_dim)
    with torch.no_grad():
        want = ref(x, grid).pooler_output
        got = ours(x, grid)
    assert got.shape == want.shape == (int(grid.prod(1).sum()) // 4, CFG.out_hidden_size)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5


def test_window_attention_matters(pair):
    """Negative control: the same weights with every layer attending over whole images differ."""
    _, ours = pair
    every = Qwen25VisionTower(Qwen25VisionConfig(**{**CFG.__dict__, "fullatt_block_indexes": [0, 1, 2]})).eval()
    every.load_state_dict(ours.state_dict())
    grid = torch.tensor([[1, 12, 20]])
    x = torch.randn(240, CFG.patch_dim)
    with torch.no_grad():
        assert (every(x, grid) - ours(x, grid)).abs().max() > 1e-4


def test_round_trip_and_config(pair):
    ref, ours = pair
    back = lf_to_hf(QWEN25_VISION_TABLE, ours.state_dict(), CFG)
    sd = ref.state_dict()
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    assert Qwen25VisionConfig.from_hf(ref.config.to_dict()) == CFG
    with pytest.raises(UserError, match="hidden_act='gelu' is not supported"):
        Qwen25VisionConfig.from_hf({**ref.config.to_dict(), "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="do not hold the patches"):
        ours(torch.randn(10, CFG.patch_dim), [[1, 4, 4]])
