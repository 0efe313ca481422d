"""GLM-4.5 (glm4_moe): grouped-query attention with q/k/v bias, half of each head rotated and
optional q/k norms, under DeepSeek-V3's MoE (sigmoid routing with the expert bias, shared
experts, first dense layers): the same code as the other families, configured; against HF
transformers' Glm4MoeForCausalLM on tiny random configs."""

import json

import pytest
import torch
from conftest import assert_greedy_matches_hf, assert_round_trip, logits_error, make_hf_model, spread_router
from loongforge.llm import load_model

CASES = {
    "bias-partial-rotary": dict(
        attention_bias=True, use_qk_norm=False, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5
    ),
    "qknorm-two-shared": dict(
        attention_bias=False, use_qk_norm=True, n_shared_experts=2, first_k_dense_replace=0, routed_scaling_factor=1.0
    ),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    kw = dict(
        num_mtp_layers=0,
        num_hidden_layers=3,
        head_dim=32,
        partial_rotary_factor=0.5,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        **CASES[request.param],
    )
    hf = make_hf_model("glm4_moe", d / "init", **kw)
    spread_router(hf)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for layer in hf.model.layers:
            if layer.self_attn.q_proj.bias is not None:  # (HF initializes biases at zero)
                for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    lin.bias.normal_(0.0, 0.1, generator=g)
    hf.save_pretrained(str(d / "hf"))
    return hf, d / "hf", load_model(d / "hf")


def test_logits_match_hf(pair):
    hf, _, ours = pair
    torch.manual_seed(1)
    assert logits_error(hf, ours, torch.randint(0, 512, (2, 48))) < 1e-5
    assert ours.cfg.rotary_percent == 0.5 and ours.cfg.moe_score_function == "sigmoid"


def test_greedy_generation_matches_hf(pair):
    assert_greedy_matches_hf(pair[0], pair[2])


def test_hf_lf_hf_roundtrip_is_bit_identical(pair, tmp_path):
    hf, d, _ = pair
    c = assert_round_trip(hf, d, tmp_path)
    orig = json.loads((d / "config.json").read_text())
    for key in ("attention_bias", "use_qk_norm", "first_k_dense_replace", "n_shared_experts", "routed_scaling_factor"):
        assert c[key] == orig[key], key
