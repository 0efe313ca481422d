"""SigLIP's vision tower and the Gemma decoder against HF transformers on tiny random configs:
fp32 outputs within 1e-5 relative, HF -> LoongForge -> HF bit-identical, and the adaptive
RMSNorm reducing to Gemma's own norm when its modulation is constant."""

import pytest
import torch
import transformers
from loongforge.core.errors import UserError
from loongforge.core.foundation.gemma import GEMMA_CAUSAL_LM_TABLE, AdaRMSNorm, GemmaConfig, GemmaModel
from loongforge.core.foundation.hf_mapping import hf_to_lf, lf_to_hf
from loongforge.core.foundation.siglip import SIGLIP_VISION_TABLE, SiglipVisionConfig, SiglipVisionTower


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def hf_siglip(cfg: SiglipVisionConfig):
    torch.manual_seed(0)
    hf_cfg = transformers.SiglipVisionConfig(**cfg.hf_config(), vision_use_head=False, attention_dropout=0.0)
    return transformers.SiglipVisionModel(hf_cfg).eval()


def hf_gemma(cfg: GemmaConfig):
    torch.manual_seed(0)
    hf_cfg = transformers.GemmaConfig(**cfg.hf_config(), attention_dropout=0.0)
    model = transformers.GemmaForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # HF initializes norm weights to zero; random ones test the (1 + w) scale
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.5)
    return model


def own_state(model: torch.nn.Module) -> dict:
    return {k: v for k, v in model.state_dict().items()}


def test_siglip_tower_matches_hf():
    cfg = SiglipVisionConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, image_size=28, patch_size=7)
    hf = hf_siglip(cfg)
    hf_state = {k: v for k, v in hf.state_dict().items() if not k.endswith("position_ids")}
    ours = SiglipVisionTower(cfg).eval()
    ours.load_state_dict(hf_to_lf(SIGLIP_VISION_TABLE, hf_state, cfg), strict=True)
    pixels = torch.randn(3, 3, 28, 28)
    with torch.no_grad():
        want = hf(pixel_values=pixels).last_hidden_state
        got = ours(pixels)
    assert got.shape == (3, cfg.num_patches, 32)
    assert rel_err(got, want) < 1e-5
    # negative control: one layer's weights changed moves the output well past the tolerance
    with torch.no_grad():
        ours.layers[1].fc2.weight.mul_(1.01)
        assert rel_err(ours(pixels), want) > 1e-4


def test_siglip_layers_see_contiguous_hidden_states():
    """The patch convolution's output is channel-major; the tower hands its layers the token-major
    layout (else each residual add keeps the transposed one and each norm copies its input)."""
    tower = SiglipVisionTower(SiglipVisionConfig(num_layers=2))
    seen = []
    for layer in tower.layers:
        layer.register_forward_pre_hook(lambda m, args: seen.append(args[0].is_contiguous()))
    tower(torch.randn(2, 3, 28, 28))
    assert seen == [True, True]


def test_siglip_round_trip_is_bit_identical_and_bad_size_is_refused():
    cfg = SiglipVisionConfig()
    hf_state = {k: v for k, v in hf_siglip(cfg).state_dict().items() if not k.endswith("position_ids")}
    back = lf_to_hf(SIGLIP_VISION_TABLE, hf_to_lf(SIGLIP_VISION_TABLE, hf_state, cfg), cfg)
    assert back.keys() == hf_state.keys()
    assert all(torch.equal(back[k], hf_state[k]) for k in hf_state)
    with pytest.raises(ValueError, match=r"takes images \[batch, 3, 28, 28\]"):
        SiglipVisionTower(cfg)(torch.zeros(1, 3, 32, 32))


@pytest.mark.parametrize("heads,groups", [(4, 1), (4, 2)])
def test_gemma_logits_match_hf(heads, groups):
    cfg = GemmaConfig(
        num_layers=2, hidden_size=48, num_attention_heads=heads, num_query_groups=groups, head_dim=16, ffn_hidden_size=80, vocab_size=96
    )
    hf = hf_gemma(cfg)
    ours = GemmaModel(cfg).eval()
    ours.load_state_dict(hf_to_lf(GEMMA_CAUSAL_LM_TABLE, hf.state_dict(), cfg), strict=True)
    ids = torch.randint(0, cfg.vocab_size, (2, 11))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        got = ours.logits(ours(ours.embed(ids)))
        causal = torch.ones(11, 11, dtype=torch.bool).tril().expand(2, 11, 11)
        with_mask = ours.logits(ours(ours.embed(ids), mask=causal))
    assert rel_err(got, want) < 1e-5
    assert rel_err(with_mask, want) < 1e-5
    # negative control: positions spread twice as far apart change the relative rotary phases
    with torch.no_grad():
        shifted = ours.logits(ours(ours.embed(ids), positions=2 * torch.arange(11)))
    assert rel_err(shifted, want) > 1e-4


def test_gemma_round_trip_is_bit_identical():
    cfg = GemmaConfig(num_attention_heads=4, num_query_groups=2)
    hf_state = hf_gemma(cfg).state_dict()
    lf = hf_to_lf(GEMMA_CAUSAL_LM_TABLE, hf_state, cfg)
    back = lf_to_hf(GEMMA_CAUSAL_LM_TABLE, lf, cfg)
    saved = {k: v for k, v in hf_state.items() if k != "lm_head.weight"}  # tied: HF saves it once
    assert back.keys() == saved.keys()
    assert all(torch.equal(back[k], saved[k]) for k in saved)


def test_adaptive_norm_with_constant_modulation_is_gemma():
    """dense = 0 with bias [w | 0 | 1]: scale w, shift 0, gate 1 -> the plain Gemma layer with
    norm weight w, checked against HF on embeddings (the action expert takes no tokens)."""
    plain = GemmaConfig(
        num_layers=2, hidden_size=32, num_attention_heads=2, num_query_groups=1, head_dim=16, ffn_hidden_size=64, vocab_size=64
    )
    hf = hf_gemma(plain)
    ada_cfg = GemmaConfig(**{**plain.__dict__, "adarms_cond_dim": 8})
    ada = GemmaModel(ada_cfg, embedding=False).eval()
    lf = hf_to_lf(GEMMA_CAUSAL_LM_TABLE, hf.state_dict(), plain)
    norms = {k.removesuffix(".weight"): v for k, v in lf.items() if k.endswith("norm.weight")}
    weights = {k: v for k, v in lf.items() if k in ada.state_dict()}
    for name, w in norms.items():
        weights[name + ".dense.weight"] = torch.zeros(3 * 32, 8)
        weights[name + ".dense.bias"] = torch.cat([w, torch.zeros(32), torch.ones(32)])
    ada.load_state_dict(weights, strict=True)
    embeds = torch.randn(2, 9, 32)
    with torch.no_grad():
        want = hf.model(inputs_embeds=embeds).last_hidden_state
        got = ada(embeds, cond=torch.randn(2, 8))
    assert rel_err(got, want) < 1e-5
    # a fresh adaptive norm is gated shut: each layer returns its input
    fresh = GemmaModel(ada_cfg, embedding=False).eval()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        assert torch.equal(fresh.layers[0](x, torch.arange(5), fresh.inv_freq, cond=torch.randn(2, 8)), x)
    with pytest.raises(ValueError, match="conditioning vector"):
        AdaRMSNorm(32, 1e-6, 8)(x)


def test_gemma_config_errors():
    with pytest.raises(UserError, match="hidden_activation='gelu'"):
        GemmaConfig.from_hf(
            {
                "hidden_activation": "gelu",
                "num_attention_heads": 2,
                "num_hidden_layers": 1,
                "hidden_size": 8,
                "intermediate_size": 8,
                "vocab_size": 8,
            }
        )
    with pytest.raises(UserError, match="multiple of num_query_groups"):
        GemmaModel(GemmaConfig(num_attention_heads=3, num_query_groups=2))
    hf_cfg = transformers.GemmaConfig(**GemmaConfig(num_query_groups=2).hf_config())
    assert GemmaConfig.from_hf(hf_cfg.to_dict()) == GemmaConfig(num_query_groups=2)
