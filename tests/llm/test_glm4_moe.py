"""GLM-4.5 (glm4_moe): grouped-query attention with q/k/v bias, half of each head rotated and
optional q/k norms, under DeepSeek-V3's MoE (sigmoid routing with the expert bias, shared
experts, first dense layers): the same code as the other families, configured; against HF
transformers' Glm4MoeForCausalLM on tiny random configs."""

import json

import pytest
import torch
from conftest import make_hf_model
from loongforge.llm import load_model
from loongforge.llm.model_io import hf_to_lf, lf_to_hf
from safetensors.torch import load_file

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
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in hf.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.weight.copy_(torch.randn(gate.weight.shape, generator=g))
                gate.e_score_correction_bias.copy_(0.2 * torch.randn(gate.e_score_correction_bias.shape, generator=g))
            if layer.self_attn.q_proj.bias is not None:  # (HF initializes biases at zero)
                for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    lin.bias.normal_(0.0, 0.1, generator=g)
    hf.save_pretrained(str(d / "hf"))
    return hf, d / "hf", load_model(d / "hf")


def test_logits_match_hf(pair):
    hf, _, ours = pair
    torch.manual_seed(1)
    x = torch.randint(0, 512, (2, 48))
    with torch.no_grad():
        want, got = hf(x).logits, ours(x)
    rel = (got - want).abs().max() / want.abs().max()
    assert rel < 1e-5, f"max relative difference {rel:.3e}"
    assert ours.cfg.rotary_percent == 0.5 and ours.cfg.moe_score_function == "sigmoid"


def test_greedy_generation_matches_hf(pair):
    hf, _, ours = pair
    prompt = torch.tensor([[5, 17, 33, 2, 90]])
    want = hf.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(ours.generate(prompt, 8), want)


def test_hf_lf_hf_roundtrip_is_bit_identical(pair, tmp_path):
    hf, d, _ = pair
    hf_to_lf(d, tmp_path / "lf")
    lf_to_hf(tmp_path / "lf", tmp_path / "back")
    a, b = load_file(str(d / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    c, orig = (json.loads((p / "config.json").read_text()) for p in (tmp_path / "back", d))
    for key in ("attention_bias", "use_qk_norm", "first_k_dense_replace", "n_shared_experts", "routed_scaling_factor"):
        assert c[key] == orig[key], key
    # the export loads in transformers and computes what the original does
    import transformers

    x = torch.randint(0, 512, (1, 24))
    with torch.no_grad():
        assert torch.equal(transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).eval()(x).logits, hf(x).logits)
