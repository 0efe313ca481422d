"""Torch-native LoRA (`LoRALinear`, `add_adapters`, `merge_adapters`) against the plain formula
W x + b + scale * B A x, on a core Gemma decoder."""

import pytest
import torch
import torch.nn.functional as F
from loongforge.core.errors import UserError
from loongforge.core.foundation.gemma import GemmaConfig, GemmaModel
from loongforge.core.foundation.lora import LoRAConfig, LoRALinear, add_adapters, merge_adapters, merged_state
from loongforge.core.ops import OpTable


def test_lora_linear_is_the_formula():
    torch.manual_seed(0)
    base = torch.nn.Linear(6, 5)
    lora = LoRAConfig(rank=3, alpha=6.0)
    m = LoRALinear(base, lora, "x.linear_fc1")
    assert m.weight is base.weight and m.bias is base.bias
    x = torch.randn(4, 6)
    assert torch.equal(m(x), base(x))  # B starts at zero
    with torch.no_grad():
        m.lora_b.normal_()
    want = F.linear(x, base.weight, base.bias) + 2.0 * (x @ m.lora_a.T @ m.lora_b.T)
    torch.testing.assert_close(m(x), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(F.linear(x, m.merged_weight(), m.bias), want, rtol=1e-5, atol=1e-6)
    again = LoRALinear(torch.nn.Linear(6, 5), lora, "x.linear_fc1")
    assert torch.equal(again.lora_a, m.lora_a)  # the start depends on the run seed and the name only
    assert not torch.equal(LoRALinear(torch.nn.Linear(6, 5), lora, "y.linear_fc1").lora_a, m.lora_a)


def test_add_adapters_on_a_gemma_decoder():
    cfg = GemmaConfig(num_layers=2)
    torch.manual_seed(1)
    model = GemmaModel(cfg, OpTable())
    plain = {k: v.clone() for k, v in model.state_dict().items()}
    lora = LoRAConfig(rank=2, target_modules=["linear_qkv", "backbone.layers.1.linear_fc*"])
    names = add_adapters(model, lora, prefix="backbone.")
    assert names == [
        "backbone.layers.0.linear_qkv",
        "backbone.layers.1.linear_qkv",
        "backbone.layers.1.linear_fc1",
        "backbone.layers.1.linear_fc2",
    ]
    sd = model.state_dict()
    assert set(sd) == set(plain) | {f"{n.removeprefix('backbone.')}.lora_{x}" for n in names for x in "ab"}
    assert all(torch.equal(sd[k], v) for k, v in plain.items())  # base weights keep their names and values
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("lora_b"):
                p.normal_()
    merged = merge_adapters(model.state_dict(), lora.scale)
    assert merged.keys() == plain.keys()
    assert all(torch.equal(a, b) for a, b in zip(merged.values(), merged_state(model).values()))
    x = torch.randn(2, 5, cfg.hidden_size)
    reference = GemmaModel(cfg, OpTable())
    reference.load_state_dict(merged)
    pos = torch.arange(5).expand(2, 5)
    torch.testing.assert_close(model(x, pos), reference(x, pos), rtol=1e-5, atol=1e-5)
    base = GemmaModel(cfg, OpTable())
    base.load_state_dict(plain)
    assert not torch.allclose(model(x, pos), base(x, pos), rtol=1e-3, atol=1e-3)  # the adapters count
    with pytest.raises(UserError, match="matched no linear"):
        add_adapters(GemmaModel(cfg, OpTable()), LoRAConfig(rank=2, target_modules=["vision.*"]))
