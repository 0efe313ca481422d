"""Op-table references against HF transformers' own implementations and plain math."""

import math

import pytest
import torch
from conftest import decoder_outputs
from loongforge.core.errors import UserError
from loongforge.core.ops import OpTable
from loongforge.core.ops import reference as ref


def test_rms_norm_matches_hf_llama():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    hf = LlamaRMSNorm(48, eps=1e-6)
    hf.weight.data.normal_()
    x = torch.randn(3, 5, 48)
    torch.testing.assert_close(ref.rms_norm(x, hf.weight, 1e-6), hf(x), rtol=0, atol=0)
    xb = x.bfloat16()
    torch.testing.assert_close(ref.rms_norm(xb, hf.weight.bfloat16(), 1e-6), hf.bfloat16()(xb))


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    ],
)
def test_rope_inv_freq_matches_hf(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, rope_theta=500000.0, rope_scaling=scaling, max_position_embeddings=1024)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        hf_inv, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    else:
        hf_inv, _ = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
    torch.testing.assert_close(ref.rope_inv_freq(64, 500000.0, scaling), hf_inv.float(), rtol=1e-6, atol=0)


def test_rope_matches_hf_apply_rotary():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    b, s, h, d = 2, 7, 3, 16
    q, k = torch.randn(b, s, h, d), torch.randn(b, s, h, d)
    inv = ref.rope_inv_freq(d, 10000.0)
    pos = torch.arange(s)
    emb = torch.cat([pos[:, None].float() * inv] * 2, -1)[None]  # HF's cos/sin layout [1, s, d]
    hq, hk = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), emb.cos(), emb.sin())
    got_q, got_k = ref.rope(q, k, pos, inv)
    torch.testing.assert_close(got_q, hq.transpose(1, 2), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, hk.transpose(1, 2), rtol=1e-6, atol=1e-6)


def test_rope_partial_rotary_passes_the_rest_through():
    torch.manual_seed(0)
    x = torch.randn(1, 5, 2, 16)
    inv = ref.rope_inv_freq(8, 10000.0)  # rotary on the first 8 of 16 channels
    out, out_k = ref.rope(x, x[:, :, :1], torch.arange(5), inv)
    torch.testing.assert_close(out[..., 8:], x[..., 8:], rtol=0, atol=0)
    torch.testing.assert_close(out[..., :8], ref.rope(x[..., :8].contiguous(), x[..., :8], torch.arange(5), inv)[0])
    torch.testing.assert_close(out_k, out[:, :, :1])
    # position 0 is the identity rotation
    torch.testing.assert_close(out[:, 0], x[:, 0])


def test_rope_packed_position_ids():
    torch.manual_seed(0)
    x = torch.randn(1, 6, 1, 8)
    inv = ref.rope_inv_freq(8, 10000.0)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]])
    out, _ = ref.rope(x, x, pos, inv)
    torch.testing.assert_close(out[:, 3:], ref.rope(x[:, 3:], x[:, 3:], torch.arange(3), inv)[0])


def test_swiglu():
    x = torch.randn(4, 10)
    g, u = x[:, :5], x[:, 5:]
    torch.testing.assert_close(ref.swiglu(x), g * torch.sigmoid(g) * u)


@pytest.mark.parametrize("hq,hk", [(4, 4), (4, 2), (4, 1)])
def test_attention_causal_gqa_against_explicit_softmax(hq, hk):
    torch.manual_seed(0)
    b, s, d = 2, 9, 8
    q, k, v = torch.randn(b, hq, s, d), torch.randn(b, hk, s, d), torch.randn(b, hk, s, d)
    kk, vv = k.repeat_interleave(hq // hk, 1), v.repeat_interleave(hq // hk, 1)
    scores = q @ kk.transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    want = scores.softmax(-1) @ vv
    torch.testing.assert_close(ref.attention(q, k, v, causal=True), want, rtol=1e-5, atol=1e-6)


def test_linear_cross_entropy_ignore_index():
    torch.manual_seed(0)
    hidden, weight = torch.randn(6, 8), torch.randn(11, 8)
    labels = torch.tensor([1, -100, 3, 4, 5, -100])
    token_weights = torch.tensor([1.0, 7.0, 0.5, 1.0, 2.0, 7.0])  # ignored labels contribute 0 whatever their weight
    keep = labels != -100
    want = (torch.nn.functional.cross_entropy(hidden[keep] @ weight.T, labels[keep], reduction="none") * token_weights[keep]).sum()
    torch.testing.assert_close(ref.linear_cross_entropy(hidden, weight, labels, token_weights), want)


def test_op_table_selection_errors():
    assert OpTable.build({"rms_norm": "reference"}).rms_norm is ref.rms_norm
    from loongforge.core.registry import registry

    with pytest.raises(UserError, match="no such implementation"):
        OpTable.build({"rms_norm": "cutlass"}, registry())
    with pytest.raises(UserError, match="unknown op"):
        OpTable.build({"rmsnorm": "reference"}, registry())


def test_model_computes_through_the_op_table():
    """Every op the model uses comes from the table it was built with (no hidden fallback)."""
    from collections import Counter

    from loongforge.core.foundation.families import LLAMA, QWEN3
    from loongforge.core.foundation.spec import ModelConfig, build_gpt_model
    from loongforge.core.parallel import init_parallel

    calls = Counter()

    def counted(name, fn):
        def wrapper(*a, **k):
            calls[name] += 1
            return fn(*a, **k)

        return wrapper

    impls = {n: counted(n, f) for n, f in OpTable().impls.items()}
    ctx = init_parallel(1, 1, "gloo", "cpu")
    model = build_gpt_model(QWEN3.resolve(ModelConfig(num_layers=2)), ctx, OpTable(impls))
    model(torch.randint(0, 256, (1, 8)), None, None)
    # per layer: the input norm + q/k norms, the residual add with the MLP norm, 1 rope call (q/k
    # norms keep megatron's split), 1 attention, 1 swiglu; plus the final norm
    assert calls == Counter({"rms_norm": 2 * 3 + 1, "add_rms_norm": 2, "rope": 2, "attention": 2, "swiglu": 2})
    calls.clear()
    llama = build_gpt_model(LLAMA.resolve(ModelConfig(num_layers=2)), ctx, OpTable(impls))
    llama(torch.randint(0, 256, (1, 8)), None, None)
    # without q/k norms the split and rotation are one fused call per layer
    assert calls == Counter({"rms_norm": 2 + 1, "add_rms_norm": 2, "qkv_rope": 2, "attention": 2, "swiglu": 2})


@pytest.mark.parametrize("packed", [False, True])
def test_fused_residual_layer_equals_megatron_layer(packed):
    """The layer whose attention residual add and MLP norm are one `add_rms_norm` call computes
    exactly what megatron's TransformerLayer computes with the same ops (forced off on a copy):
    logits and every gradient bit for bit, unpacked and packed (THD)."""

    from loongforge.core.foundation.families import LLAMA
    from loongforge.core.foundation.spec import ModelConfig, build_gpt_model
    from loongforge.core.parallel import init_parallel

    ctx = init_parallel(1, 1, "gloo", "cpu")
    cfg = LLAMA.resolve(
        ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96, vocab_size=128)
    )
    torch.manual_seed(0)
    fused = build_gpt_model(cfg, ctx, OpTable())
    plain = build_gpt_model(cfg, ctx, OpTable())
    for p in fused.parameters():  # norm weights away from 1, so their gradients are checked
        if p.dim() == 1:
            p.data.uniform_(0.5, 1.5)
    plain.load_state_dict(fused.state_dict())
    assert all(layer.fused for layer in fused.decoder.layers)
    for layer in plain.decoder.layers:
        layer.fused = False
    (la, ga), (lb, gb) = decoder_outputs([fused, plain], packed)
    assert torch.equal(la, lb)
    for n in ga:
        assert torch.equal(ga[n], gb[n]), n


def test_op_table_picks_the_fastest_implementation_for_the_device():
    """loongforge-kernels registers Triton ops for CUDA: chosen by default there, never on a CPU
    (which keeps the references), and a config can name the reference back."""
    from loongforge.core.registry import registry

    cpu = OpTable.build(None, registry(), "cpu")
    assert cpu.impls == OpTable().impls
    cuda = OpTable.build(None, registry(), "cuda")
    assert (
        cuda.rms_norm.__module__ == "loongforge.kernels.rms_norm"
        and cuda.varlen_attention.__module__ == "loongforge.kernels.varlen_attention"
    )
    assert OpTable.build({"rms_norm": "reference"}, registry(), "cuda").rms_norm is ref.rms_norm
    with pytest.raises(UserError, match="runs on cuda, not cpu"):
        OpTable.build({"rms_norm": "triton"}, registry(), "cpu")


def test_packed_attention_against_explicit_softmax_per_sample():
    """Bidirectional attention inside each sample of a pack, queries and keys bounded apart
    (cross-attention to each sample's own context), against softmax(q k^T) v written out."""
    torch.manual_seed(0)
    lq, lk, h, d = [3, 5, 2], [4, 4, 6], 2, 8
    q, k, v = torch.randn(sum(lq), h, d), torch.randn(sum(lk), h, d), torch.randn(sum(lk), h, d)
    cu_q = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()])
    cu_k = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()])
    out = ref.packed_attention(q, k, v, cu_q, cu_k)
    for i in range(3):
        qi, ki, vi = (t[c[i] : c[i + 1]] for t, c in ((q, cu_q), (k, cu_k), (v, cu_k)))
        w = torch.softmax(torch.einsum("qhd,khd->hqk", qi, ki) / math.sqrt(d), -1)
        torch.testing.assert_close(out[cu_q[i] : cu_q[i + 1]], torch.einsum("hqk,khd->qhd", w, vi), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="3 query samples but 2 key samples"):
        ref.packed_attention(q, k, v, cu_q, cu_k[:-1])


def test_rotary_with_angle_tables_equals_rope_of_positions():
    """`rotary` with cos / sin of position * inv_freq is `rope` of those positions (both layouts)."""
    torch.manual_seed(0)
    q, k = torch.randn(1, 6, 4, 16), torch.randn(1, 6, 2, 16)
    pos, inv = torch.arange(6), ref.rope_inv_freq(16, 10000.0)
    ang = (pos[:, None].float() * inv)[None, :, None, :]
    for inter in (True, False):
        for a, b in zip(ref.rotary(q, k, ang.cos(), ang.sin(), inter), ref.rope(q, k, pos, inv, inter)):
            torch.testing.assert_close(a, b)
