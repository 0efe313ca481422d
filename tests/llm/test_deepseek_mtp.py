"""DeepSeek-V3 multi-token prediction: HF's DeepseekV3ForCausalLM has no MTP modules, so the
reference is built from HF's own pieces (its decoder layer class, norms, embedding and head) on
the MTP weights of the DeepSeek-V3 checkpoint layout; our MTP loss equals it, the weights go
HF -> LF -> HF unchanged, packed samples give the loss of the samples run one by one, and a run
trains with the MTP loss reported per depth."""

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import FAST, losses, run_cli
from loongforge.llm import load_model
from loongforge.llm.model_io import hf_to_lf, lf_to_hf
from safetensors.torch import load_file, save_file
from test_deepseek import CASES, make_deepseek


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
    state[prefix + "shared_head.head.weight"] = state["lm_head.weight"].clone()
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
    hf, path = make_deepseek(d, **CASES["qlatent-yarn-groups"])
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
    assert set(a) == set(b) and "model.layers.3.eh_proj.weight" in a and "model.layers.3.mlp.experts.7.up_proj.weight" in a
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert json.loads((tmp_path / "back" / "config.json").read_text())["num_nextn_predict_layers"] == 1


def test_training_with_mtp_reports_its_loss(mtp_model, tmp_path):
    _, d, *_ = mtp_model
    r = run_cli(
        [
            "train",
            "tiny",
            *FAST,
            "train.train_iters=4",
            f"checkpoint.load={d}",
            f"checkpoint.run_dir={tmp_path}",
            "model.mtp_loss_weight=0.3",
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(2.0 < row["mtp_loss_1"] < 12.0 for row in rows)  # a cross-entropy over 512 tokens
    assert losses(tmp_path)[4] < losses(tmp_path)[1] and rows[-1]["mtp_loss_1"] < rows[0]["mtp_loss_1"]
