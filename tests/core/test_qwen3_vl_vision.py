"""Qwen3-VL's vision tower in core's foundation against HF transformers' (the oracle) on a tiny
random config: merged features and every DeepStack feature within 1e-5 relative (fp32, CPU) for
packed images and a 2-frame video of different sizes, the 4x4 learned position grid resampled up
and down; HF -> LoongForge -> HF every tensor bit-identical."""

import pytest
import torch
import torch.nn.functional as F
from conftest import perturbed
from loongforge.core.errors import UserError
from loongforge.core.foundation.hf_mapping import hf_to_lf, lf_to_hf
from loongforge.core.foundation.qwen3_vl_vision import QWEN3_VISION_TABLE, Qwen3VisionConfig, Qwen3VisionTower

CFG = Qwen3VisionConfig(
    depth=3,
    hidden_size=32,
    intermediate_size=48,
    num_heads=4,
    patch_size=4,
    spatial_merge_size=2,
    out_hidden_size=24,
    num_position_embeddings=16,
    deepstack_visual_indexes=[0, 2],
)


def rel(got, want) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.fixture(scope="module")
def pair():
    from transformers import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    hc = Qwen3VLVisionConfig(**CFG.hf_config())
    hc._attn_implementation = "sdpa"
    ref = perturbed(lambda: Qwen3VLVisionModel(hc))
    ours = Qwen3VisionTower(CFG).eval()
    ours.load_state_dict(hf_to_lf(QWEN3_VISION_TABLE, ref.state_dict(), CFG), strict=True)
    return ref, ours


@pytest.mark.parametrize("grid", [[[1, 12, 20], [2, 8, 6]], [[1, 10, 14], [1, 4, 4], [1, 2, 6], [3, 2, 2]]])
def test_features_match_hf(pair, grid):
    ref, ours = pair
    grid = torch.tensor(grid)
    x = torch.randn(int(grid.prod(1).sum()), CFG.patch_dim)
    with torch.no_grad():
        out = ref(x, grid)
        got, deep = ours(x, grid)
    want, want_deep = out.pooler_output, out.deepstack_features
    assert got.shape == want.shape == (int(grid.prod(1).sum()) // 4, CFG.out_hidden_size)
    errors = [rel(got, want)] + [rel(g, w) for g, w in zip(deep, want_deep, strict=True)]
    assert len(deep) == len(CFG.deepstack_visual_indexes) and all(g.shape == want.shape for g in deep)
    assert max(errors) < 1e-5, errors


def test_position_embedding_matters(pair, monkeypatch):
    """Negative controls: zeroed learned positions, or the grid resampled with half-pixel centres
    instead of HF's align_corners, miss HF by far more than the tolerance."""
    ref, ours = pair
    grid = torch.tensor([[1, 6, 10], [1, 2, 2]])
    x = torch.randn(64, CFG.patch_dim)
    with torch.no_grad():
        want = ref(x, grid).pooler_output
        assert rel(ours(x, grid)[0], want) < 1e-5
        zeroed = Qwen3VisionTower(CFG).eval()
        zeroed.load_state_dict(ours.state_dict())
        zeroed.pos_embed.weight.zero_()
        assert rel(zeroed(x, grid)[0], want) > 1e-3
        interpolate = F.interpolate
        monkeypatch.setattr(F, "interpolate", lambda *a, **k: interpolate(*a, **{**k, "align_corners": False}))
        assert rel(ours(x, grid)[0], want) > 1e-3


def test_round_trip_and_config(pair):
    ref, ours = pair
    back = lf_to_hf(QWEN3_VISION_TABLE, ours.state_dict(), CFG)
    sd = ref.state_dict()
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    assert Qwen3VisionConfig.from_hf(ref.config.to_dict()) == CFG
    d = ref.config.to_dict()
    for bad, match in [
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "rope_type='default' is not supported"),
        ({"num_position_embeddings": 15}, "num_position_embeddings=15 is not supported"),
        ({"deepstack_visual_indexes": [0, 3]}, r"deepstack_visual_indexes=\[0, 3\] is not supported"),
        ({"patch_size": [4, 4]}, r"patch_size=\[4, 4\] is not supported"),
    ]:
        with pytest.raises(UserError, match=match):
            Qwen3VisionConfig.from_hf({**d, **bad})
    with pytest.raises(ValueError, match="do not hold the patches"):
        ours(torch.randn(10, CFG.patch_dim), [[1, 4, 4]])
