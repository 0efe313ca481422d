"""Packing: bins, layout, and a packed batch giving each sample's own losses and gradients."""

import random

import pytest
import torch
from loongforge.core.data import best_fit_decreasing, pack_samples, packing_efficiency
from loongforge.core.errors import UserError
from loongforge.core.ops import reference as ref


def test_best_fit_decreasing_fills_bins():
    rng = random.Random(0)
    lengths = [rng.randint(1, 60) for _ in range(200)]
    bins = best_fit_decreasing(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(200))
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
    lower_bound = -(-sum(lengths) // 64)
    assert len(bins) <= lower_bound * 1.1 + 1
    assert packing_efficiency(lengths, bins, 64) > 0.9
    assert best_fit_decreasing([5, 4, 3, 2], 7) == [[0, 3], [1, 2]]
    with pytest.raises(UserError, match="does not fit seq_length=8"):
        best_fit_decreasing([3, 9], 8)


def test_pack_layout_and_alignment():
    s = [{"tokens": torch.arange(3), "labels": torch.arange(1, 4)}, {"tokens": torch.arange(5), "labels": torch.arange(1, 6)}]
    p = pack_samples(s, [1, 0], 16, pad_id=0, align=2)
    assert p.cu_seqlens.tolist() == [0, 6, 10, 16]
    assert p.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5]
    assert p.loss_mask[0].tolist() == [1] * 5 + [0] + [1] * 3 + [0] + [0] * 6
    assert torch.equal(ref.positions_from_cu_seqlens(p.cu_seqlens, 16), p.position_ids[0])


def test_varlen_attention_never_crosses_samples():
    torch.manual_seed(0)
    q, k, v = torch.randn(10, 4, 8), torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    out = ref.varlen_attention(q, k, v, cu)
    second = ref.attention(q[4:].transpose(0, 1)[None], k[4:].transpose(0, 1)[None], v[4:].transpose(0, 1)[None])
    torch.testing.assert_close(out[4:], second[0].transpose(0, 1))
    v2 = v.clone()
    v2[:4] += 100.0  # changing the first sample leaves the second untouched
    torch.testing.assert_close(ref.varlen_attention(q, k, v2, cu)[4:], out[4:], rtol=0, atol=0)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_packed_losses_and_grads_equal_one_by_one(family):
    from loongforge.core.foundation.families import LLAMA, QWEN3
    from loongforge.core.foundation.spec import ModelConfig, build_gpt_model
    from loongforge.core.parallel import init_parallel

    fam = {"llama": LLAMA, "qwen3": QWEN3}[family]
    ctx = init_parallel(1, 1, "gloo", "cpu")
    torch.manual_seed(0)
    model = build_gpt_model(fam.resolve(ModelConfig(num_layers=2, num_query_groups=2)), ctx)
    rng = random.Random(1)
    samples = []
    for _ in range(6):
        n = rng.randint(3, 20)
        t = torch.randint(0, 256, (n + 1,))
        samples.append({"tokens": t[:-1], "labels": t[1:]})
    lengths = [s["tokens"].numel() for s in samples]
    bins = best_fit_decreasing(lengths, 32)
    assert len(bins) < len(samples)

    model.zero_grad()
    single = {}
    for i, s in enumerate(samples):
        loss = model(s["tokens"][None], None, None, labels=s["labels"][None])[0]
        single[i] = loss.detach()
        loss.sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    for b in bins:
        p = pack_samples(samples, b, 32, pad_id=0)
        loss = model(p.tokens, None, None, labels=p.labels, packed_seq_params=p.packed_seq_params())[0]
        bounds = p.cu_seqlens.tolist()
        for j, i in enumerate(p.samples):
            torch.testing.assert_close(loss[bounds[j] : bounds[j + 1]].detach(), single[i], rtol=1e-5, atol=1e-6)
        (loss * p.loss_mask[0]).sum().backward()
    for n, p_ in model.named_parameters():
        torch.testing.assert_close(p_.grad, want[n], rtol=1e-5, atol=1e-6, msg=n)
