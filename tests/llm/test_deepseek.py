"""DeepSeek-V3: multi-head latent attention (with and without a query latent, YaRN or plain
rotary, interleaved or not), sigmoid routing with the aux-loss-free expert bias, group-limited
top-k, shared experts, first dense layers, scaled routed outputs; against HF transformers'
DeepseekV3ForCausalLM on tiny random configs (logits, greedy tokens, HF -> LF -> HF), the bias
update during training, and EP=2 against EP=1."""

import json
import shutil

import pytest
import torch
from conftest import FAST, assert_greedy_matches_hf, assert_round_trip, logits_error, losses, make_hf_model, run_cli, spread_router
from loongforge.llm import load_model
from safetensors.torch import load_file, save_file

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
BASE = dict(
    num_mtp_layers=0,  # (HF's model has no MTP modules; test_deepseek_mtp.py adds them)
    intermediate_size=128,
    moe_intermediate_size=32,
    num_key_value_heads=4,
    n_routed_experts=8,
    kv_lora_rank=32,
    qk_rope_head_dim=16,
    v_head_dim=24,
    qk_nope_head_dim=32,
)
CASES = {
    # a query latent, YaRN, 4 groups of which 2 per token, one shared expert, a dense first layer
    "qlatent-yarn-groups": dict(
        q_lora_rank=48,
        rope_parameters=YARN,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=4,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        num_hidden_layers=3,
    ),
    # one query projection, plain rotary in HF's half-split layout, no groups, two shared experts
    "qproj-rope-halfsplit": dict(
        q_lora_rank=None,
        rope_interleave=False,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=2,
        n_shared_experts=2,
        first_k_dense_replace=0,
        routed_scaling_factor=1.0,
        num_hidden_layers=2,
    ),
}


def make_deepseek(d, **kw):
    hf = make_hf_model("deepseek_v3", d / "init", **{**BASE, **kw})
    spread_router(hf)
    hf.save_pretrained(str(d / "hf"))
    return hf, d / "hf"


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    hf, d = make_deepseek(tmp_path_factory.mktemp(request.param), **CASES[request.param])
    return hf, d, load_model(d)


def test_logits_match_hf(pair, tmp_path):
    hf, d, ours = pair
    torch.manual_seed(1)
    x = torch.randint(0, 512, (2, 48))  # longer than YaRN's original 32 positions
    assert logits_error(hf, ours, x) < 1e-5
    # negative control: without the expert bias other experts are chosen, and the logits differ
    shutil.copytree(d, tmp_path / "nobias")
    state = load_file(str(tmp_path / "nobias" / "model.safetensors"))
    save_file(
        {k: (torch.zeros_like(v) if "e_score_correction_bias" in k else v) for k, v in state.items()},
        str(tmp_path / "nobias" / "model.safetensors"),
    )
    assert logits_error(hf, load_model(tmp_path / "nobias"), x) > 1e-3


def test_greedy_generation_matches_hf(pair):
    assert_greedy_matches_hf(pair[0], pair[2])


def test_hf_lf_hf_roundtrip_is_bit_identical(pair, tmp_path):
    hf, d, _ = pair
    c = assert_round_trip(hf, d, tmp_path)
    assert any("e_score_correction_bias" in k for k in load_file(str(d / "model.safetensors")))
    orig = json.loads((d / "config.json").read_text())
    for key in (
        "first_k_dense_replace",
        "n_group",
        "topk_group",
        "routed_scaling_factor",
        "n_shared_experts",
        "q_lora_rank",
        "kv_lora_rank",
        "rope_interleave",
    ):
        assert c[key] == orig[key], key
    assert c["rope_parameters"]["rope_type"] == orig["rope_parameters"]["rope_type"]


def test_kimi_k2_config_reads_as_deepseek_v3(pair, tmp_path):
    """Kimi-K2's config.json is DeepSeek-V3's architecture under model_type kimi_k2 with remote-code
    class names: it loads as the deepseek_v3 family and gives the same logits."""
    hf, d, ours = pair
    shutil.copytree(d, tmp_path / "kimi")
    c = json.loads((tmp_path / "kimi" / "config.json").read_text())
    c.update(model_type="kimi_k2", auto_map={"AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"})
    (tmp_path / "kimi" / "config.json").write_text(json.dumps(c))
    kimi = load_model(tmp_path / "kimi")
    assert kimi.family.name == "deepseek_v3"
    x = torch.randint(0, 512, (1, 16))
    with torch.no_grad():
        assert torch.equal(kimi(x), ours(x))


# ---- training ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_ds(tmp_path_factory):
    _, d = make_deepseek(tmp_path_factory.mktemp("hf_ds"), **CASES["qlatent-yarn-groups"])
    return d


def _train(run_dir, hf, *extra, nproc=1, steps=3):
    args = ["train", "tiny", *FAST, f"train.train_iters={steps}", f"checkpoint.load={hf}", f"checkpoint.run_dir={run_dir}"]
    r = run_cli([*args, *extra], nproc=nproc)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def ds_one(hf_ds, tmp_path_factory):
    """Three steps on one process, the expert bias moving 0.01 a step, exported to HF."""
    d = tmp_path_factory.mktemp("ds_one")
    _train(d, hf_ds, "model.moe_bias_update_rate=0.01", "checkpoint.export_hf=true")
    return d


def test_expert_bias_moves_towards_balance(hf_ds, ds_one):
    """Each optimizer step moves every expert's bias by exactly +-rate (towards the experts that
    got fewer tokens than the mean); the gradient never touches it."""
    before = load_file(str(hf_ds / "model.safetensors"))
    after = load_file(str(ds_one / "hf" / "model.safetensors"))
    for layer in (1, 2):
        key = f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
        steps = (after[key] - before[key]) / 0.01
        # three steps of +-1: an odd number between -3 and 3
        assert torch.allclose(steps, steps.round(), atol=1e-3) and set(steps.round().abs().tolist()) <= {1.0, 3.0}, steps
    assert losses(ds_one)[3] < losses(ds_one)[1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        ["parallel.expert_model_parallel_size=2"],
        # latent attention with TP=2 under sequence parallelism: down projections and latent
        # norms on each rank's share of the sequence, the rotary key gathered
        ["parallel.expert_model_parallel_size=2", "parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"],
    ],
    ids=["ep2", "ep2-tp2-sp"],
)
def test_expert_parallel_two_processes_match_one(layout, hf_ds, ds_one, tmp_path):
    _train(tmp_path, hf_ds, "model.moe_bias_update_rate=0.01", "checkpoint.export_hf=true", *layout, nproc=2)
    want, got = losses(ds_one), losses(tmp_path)
    for step in want:
        assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), (step, got[step], want[step])
    # the bias updates count the tokens of both data-parallel (or sequence-parallel) ranks: the same biases as one process
    a, b = (load_file(str(r / "hf" / "model.safetensors")) for r in (ds_one, tmp_path))
    for k in a:
        if "e_score_correction_bias" in k:
            assert torch.equal(a[k], b[k]), k
