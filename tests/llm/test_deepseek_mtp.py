"""DeepSeek-V3 multi-token prediction: HF's DeepseekV3ForCausalLM has no MTP modules, so the
reference is built from HF's own pieces (its decoder layer class, norms, embedding and head) on
the MTP weights of the DeepSeek-V3 checkpoint layout; our MTP loss equals it, the weights go
HF -> LF -> HF unchanged, packed samples give the loss of the samples run one by one, a run
trains with the MTP loss reported per depth, and TP=2 and PP=2 on 2 gloo processes give the
single-process losses and trained weights (MoE layers need TP=1: TP=2 runs DeepSeek-V3's
attention with dense MLPs)."""

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import FAST, losses, run_cli
from loongforge.llm import load_model
from loongforge.llm.model_io import hf_to_lf, lf_to_hf
from safetensors.torch import load_file, save_file
from test_deepseek import CASES, make_deepseek

# two decoder layers (a dense one, then MoE) so that PP=2 puts one on each stage; the MTP module
# (HF layer 2) is MoE
MOE = {**CASES["qlatent-yarn-groups"], "num_hidden_layers": 2}
# the same attention with every MLP dense (the MTP module's too): MoE layers refuse TP > 1
DENSE = {**MOE, "n_routed_experts": 0, "first_k_dense_replace": 3, "n_group": 1, "topk_group": 1, "n_shared_experts": 0}


def add_mtp_weights(hf, d, seed=3):
    """Write MTP module 0 (HF layer num_layers) into the checkpoint as DeepSeek-V3 stores it:
    a decoder layer (MoE), enorm, hnorm, eh_proj, shared_head.norm, and copies of the embedding
    and the output head; config.json says num_nextn_predict_layers=1. Returns the layer and norms."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

    cfg = hf.config
    n, h = cfg.num_hidden_layers, cfg.hidden_size
    torch.manual_seed(seed)
    layer = m.DeepseekV3DecoderLayer(cfg, layer_idx=n).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.1)
        if hasattr(layer.mlp, "gate"):  # a MoE layer
            layer.mlp.gate.weight.normal_()
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.2)
    parts = {
        "enorm": m.DeepseekV3RMSNorm(h, cfg.rms_norm_eps),
        "hnorm": m.DeepseekV3RMSNorm(h, cfg.rms_norm_eps),
        "shared_head.norm": m.DeepseekV3RMSNorm(h, cfg.rms_norm_eps),
        "eh_proj": torch.nn.Linear(2 * h, h, bias=False),
    }
    with torch.no_grad():
        for p in (q for mod in parts.values() for q in mod.parameters()):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape) if p.dim() == 1 else 0.1 * torch.randn(p.shape))
    state = load_file(str(d / "model.safetensors"))
    prefix = f"model.layers.{n}."
    for k, v in layer.state_dict().items():
        if k == "mlp.experts.gate_up_proj":  # the checkpoint keeps one tensor per expert, as save_pretrained writes
            for e, w in enumerate(v):
                gate, up = w.chunk(2)
                state[prefix + f"mlp.experts.{e}.gate_proj.weight"] = gate.clone().contiguous()
                state[prefix + f"mlp.experts.{e}.up_proj.weight"] = up.clone().contiguous()
        elif k == "mlp.experts.down_proj":
            for e, w in enumerate(v):
                state[prefix + f"mlp.experts.{e}.down_proj.weight"] = w.clone().contiguous()
        else:
            state[prefix + k] = v.detach().clone().contiguous()
    state |= {prefix + f"{name}.{k}": v.detach().clone() for name, mod in parts.items() for k, v in mod.state_dict().items()}
    state[prefix + "embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    # (a tied checkpoint has no lm_head: its head is the embedding)
    state[prefix + "shared_head.head.weight"] = state.get("lm_head.weight", state["model.embed_tokens.weight"]).clone()
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    c = json.loads((d / "config.json").read_text())
    c["num_nextn_predict_layers"] = 1
    (d / "config.json").write_text(json.dumps(c))
    return layer, parts


def _shift(t, fill):
    return torch.cat([t[:, 1:], t.new_full((t.shape[0], 1), fill)], dim=1)


def reference_mtp_loss(hf, layer, parts, ids, labels, weights):
    """DeepSeek-V3's MTP depth 1 on HF's modules: sum of weights * CE of the next-next token."""
    with torch.no_grad():
        h0 = hf.model(ids).last_hidden_state  # after the final norm, as megatron-core feeds its MTP
        emb = hf.model.embed_tokens(_shift(ids, 0))
        x = parts["eh_proj"](torch.cat([parts["enorm"](emb), parts["hnorm"](h0)], dim=-1))
        pos = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
        out = layer(x, attention_mask=None, position_ids=pos, position_embeddings=hf.model.rotary_emb(x, pos))
        logits = hf.lm_head(parts["shared_head.norm"](out))
        ce = F.cross_entropy(logits.flatten(0, 1), _shift(labels, 0).flatten(), reduction="none")
        return (ce * _shift(weights, 0.0).flatten()).sum()


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("mtp")
    hf, path = make_deepseek(d, **MOE)
    layer, parts = add_mtp_weights(hf, path)
    return hf, path, layer, parts, load_model(path)


def test_mtp_loss_matches_a_reference_on_hf_modules(mtp_model):
    hf, _, layer, parts, ours = mtp_model
    torch.manual_seed(0)
    ids = torch.randint(0, 512, (2, 40))
    labels = _shift(ids, 0)
    weights = torch.ones(2, 40)
    weights[:, -1] = 0
    weights[1, :7] = 0  # a masked prompt
    want = reference_mtp_loss(hf, layer, parts, ids, labels, weights)
    with torch.no_grad():
        main = ours.gpt(ids, None, None, labels=labels, loss_mask=weights)
        got = ours.gpt.multi_token_prediction.losses[0]
        # the main loss is the next-token loss alone (MTP joins backward only)
        want_main = (F.cross_entropy(hf(ids).logits.flatten(0, 1), labels.flatten(), reduction="none") * weights.flatten()).sum()
    assert abs(float(got) - float(want)) <= 1e-5 * float(want), (float(got), float(want))
    assert abs(float(main) - float(want_main)) <= 1e-5 * float(want_main)
    # negative control: another projection into the MTP layer gives another loss
    proj = ours.gpt.multi_token_prediction.layers[0].eh_proj.weight
    kept = proj.detach().clone()
    with torch.no_grad():
        proj.add_(0.3 * torch.randn(proj.shape, generator=torch.Generator().manual_seed(5)))
        ours.gpt(ids, None, None, labels=labels, loss_mask=weights)
        assert abs(float(ours.gpt.multi_token_prediction.losses[0]) - float(want)) > 1e-4 * float(want)  # 10x the tolerance
        proj.copy_(kept)


def test_packed_samples_give_the_mtp_loss_of_each_sample(mtp_model):
    from megatron.core.packed_seq_params import PackedSeqParams

    *_, ours = mtp_model
    torch.manual_seed(1)
    a, b = torch.randint(0, 512, (1, 13)), torch.randint(0, 512, (1, 9))

    def loss_of(ids, wts, packed=None):
        labels = _shift(ids, 0)
        with torch.no_grad():
            ours.gpt(ids, None, None, labels=labels, loss_mask=wts, packed_seq_params=packed)
        return float(ours.gpt.multi_token_prediction.losses[0])

    wa, wb = torch.ones(1, 13), torch.ones(1, 9)
    wa[0, -1] = wb[0, -1] = 0  # each sample's last token has no next token
    one_by_one = loss_of(a, wa) + loss_of(b, wb)
    cu = torch.tensor([0, 13, 22], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=13, max_seqlen_kv=13)
    packed = loss_of(torch.cat([a, b], 1), torch.cat([wa, wb], 1), params)
    assert abs(packed - one_by_one) <= 1e-5 * one_by_one, (packed, one_by_one)


def test_mtp_weights_round_trip_bit_identical(mtp_model, tmp_path):
    _, d, *_ = mtp_model
    hf_to_lf(d, tmp_path / "lf")
    lf_to_hf(tmp_path / "lf", tmp_path / "back")
    a, b = load_file(str(d / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert set(a) == set(b) and "model.layers.2.eh_proj.weight" in a and "model.layers.2.mlp.experts.7.up_proj.weight" in a
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert json.loads((tmp_path / "back" / "config.json").read_text())["num_nextn_predict_layers"] == 1


def test_tied_mtp_weights_round_trip_without_lm_head(tmp_path):
    """With tied embeddings the MTP head copies are the embedding: HF -> LF -> HF gives the
    checkpoint back with no lm_head, and a head copy that is not the embedding is refused."""
    from loongforge.core.errors import UserError

    hf, d = make_deepseek(tmp_path, **DENSE, tie_word_embeddings=True)
    add_mtp_weights(hf, d)
    hf_to_lf(d, tmp_path / "lf")
    lf_to_hf(tmp_path / "lf", tmp_path / "back")
    a, b = load_file(str(d / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert set(a) == set(b) and "lm_head.weight" not in b and "model.layers.2.shared_head.head.weight" in b
    for k in a:
        assert torch.equal(a[k], b[k]), k
    a["model.layers.2.shared_head.head.weight"] += 1.0
    save_file(a, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"shared_head.head.weight and the one read before them differ"):
        hf_to_lf(d, tmp_path / "lf2")


def _train(run_dir, hf, *extra, nproc=1):
    args = [
        "train",
        "tiny",
        *FAST,
        "train.train_iters=4",
        f"checkpoint.load={hf}",
        f"checkpoint.run_dir={run_dir}",
        "model.mtp_loss_weight=0.3",
        "checkpoint.export_hf=true",
    ]
    r = run_cli([*args, *extra], nproc=nproc)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def mtp_one(mtp_model, tmp_path_factory):
    """Four steps of the MoE model with MTP on one process, exported to HF."""
    d = tmp_path_factory.mktemp("mtp_one")
    return d, _train(d, mtp_model[1])


def test_training_with_mtp_reports_its_loss(mtp_one):
    d, rows = mtp_one
    assert all(2.0 < row["mtp_loss_1"] < 12.0 for row in rows)  # a cross-entropy over 512 tokens
    assert losses(d)[4] < losses(d)[1] and rows[-1]["mtp_loss_1"] < rows[0]["mtp_loss_1"]


@pytest.fixture(scope="module")
def dense_one(tmp_path_factory):
    """DeepSeek-V3's attention with dense MLPs and an MTP module, four steps on one process."""
    d = tmp_path_factory.mktemp("mtp_dense")
    hf, path = make_deepseek(d, **DENSE)
    add_mtp_weights(hf, path)
    run = d / "one"
    return path, run, _train(run, path)


@pytest.fixture(scope="module")
def tied_one(tmp_path_factory):
    """The dense model with tied embeddings (the embedding is the output layer of the main and
    the MTP loss and MTP's input embedding), four steps on one process."""
    d = tmp_path_factory.mktemp("mtp_tied")
    hf, path = make_deepseek(d, **DENSE, tie_word_embeddings=True)
    add_mtp_weights(hf, path)
    run = d / "one"
    return path, run, _train(run, path)


@pytest.mark.slow
@pytest.mark.parametrize(
    "one_run, layout",
    [
        ("dense_one", "parallel.tensor_model_parallel_size=2"),
        ("mtp_one", "parallel.pipeline_model_parallel_size=2"),
        # MoE layers (the MTP module's too) at TP > 1 run under sequence parallelism
        ("mtp_one", "parallel.tensor_model_parallel_size=2 parallel.sequence_parallel=true"),
        # the last stage's one copy of the embedding serves MTP's input and the output layer
        ("tied_one", "parallel.pipeline_model_parallel_size=2"),
    ],
)
def test_two_process_layout_with_mtp_matches_one(one_run, layout, request, tmp_path):
    """The main and MTP losses and the gradient norm of every step, and the trained weights of
    the HF export (the checkpoint saved at TP=2 / PP=2, read back at TP=1), equal one process's."""
    if one_run == "mtp_one":
        hf = request.getfixturevalue("mtp_model")[1]
        one, want = request.getfixturevalue("mtp_one")
    else:
        hf, one, want = request.getfixturevalue(one_run)
    got = _train(tmp_path, hf, *layout.split(), nproc=2)
    assert [r["step"] for r in got] == [1, 2, 3, 4] and set(got[0]) == set(want[0])  # (the MTP layer's MoE metrics among them)
    for g, w in zip(got, want):
        for key in ("loss", "mtp_loss_1", "grad_norm"):
            assert abs(g[key] - w[key]) <= 1e-5 * abs(w[key]), (layout, g["step"], key, g[key], w[key])
    assert want[-1]["mtp_loss_1"] < want[0]["mtp_loss_1"]
    a, b = (load_file(str(r / "hf" / "model.safetensors")) for r in (one, tmp_path))
    start = load_file(str(hf / "model.safetensors"))
    assert sorted(a) == sorted(b) == sorted(start) and "model.layers.2.eh_proj.weight" in a
    # four AdamW steps at lr 3e-3 move each weight by ~1e-2 (checked on the MTP module's); the
    # layouts' fp32 sums differ in order, which Adam's g / (|g| + eps) turns into ~1e-5 where a
    # gradient is near zero (as tests/llm/test_stacks.py measured): 1e-4 is 1% of the update
    for k in a:
        if k.startswith("model.layers.2.") and "embed_tokens" not in k and "shared_head.head" not in k:
            assert (a[k] - start[k]).abs().max() > 1e-3, k
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-4, msg=k)
    if one_run == "tied_one":  # no lm_head; MTP's head copy is the trained embedding
        assert "lm_head.weight" not in b and torch.equal(b["model.layers.2.shared_head.head.weight"], b["model.embed_tokens.weight"])
    # the export loads in LoongForge, MTP module included
    assert load_model(tmp_path / "hf").gpt.multi_token_prediction is not None
