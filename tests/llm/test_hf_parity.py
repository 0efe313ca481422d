"""Our megatron-core model against HF transformers on tiny random configs of every family."""

import pytest
import torch
from conftest import assert_greedy_matches_hf, assert_round_trip, logits_error, make_hf_model
from loongforge.llm import load_model
from loongforge.llm.model_io import hf_to_lf

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
CASES = {
    "llama3-gqa": ("llama", dict(rope_scaling=LLAMA3_ROPE, rope_theta=500000.0)),
    "llama2-mha-tied": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "qwen2-bias-tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen2-bias-untied": ("qwen2", dict(tie_word_embeddings=False)),
    "qwen3-qknorm-headdim": ("qwen3", dict(head_dim=24, tie_word_embeddings=False)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    family, kw = CASES[request.param]
    d = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(family, d, **kw)
    return hf, d, load_model(d)


def test_logits_match_hf(pair):
    hf, _, ours = pair
    torch.manual_seed(1)
    assert logits_error(hf, ours, torch.randint(0, 512, (2, 48))) < 1e-5


def test_greedy_generation_matches_hf(pair):
    assert_greedy_matches_hf(pair[0], pair[2])


def test_hf_lf_hf_roundtrip_is_bit_identical(pair, tmp_path):
    hf, d, _ = pair
    assert_round_trip(hf, d, tmp_path)


def test_checkpoint_loads_with_same_logits(pair, tmp_path):
    hf, d, ours = pair
    hf_to_lf(d, tmp_path / "lf")
    again = load_model(tmp_path / "lf")
    x = torch.randint(0, 512, (1, 20))
    with torch.no_grad():
        assert torch.equal(again(x), ours(x))


def test_exported_config_loads_in_transformers(pair, tmp_path):
    import transformers

    hf, d, ours = pair
    ours.save_hf(tmp_path / "out")
    re = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    assert type(re) is type(hf)
    x = torch.randint(0, 512, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(re(x).logits, hf(x).logits, rtol=0, atol=0)
