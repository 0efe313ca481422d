"""Family-agnostic HF I/O: rows with several repeat placeholders, nested HF config sections,
family options read from the spec rather than from the family's name."""

import json
from dataclasses import dataclass

import pytest
import torch
from loongforge.core.errors import UserError
from loongforge.core.foundation.families import LLAMA, QWEN2, QWEN3
from loongforge.core.foundation.hf_io import hf_config_dict, read_hf_config
from loongforge.core.foundation.hf_mapping import Row, hf_to_lf, lf_to_hf
from loongforge.core.foundation.spec import ModelConfig


@dataclass
class ExpertConfig:
    num_layers: int = 2
    num_experts: int = 3

    def repeats(self):
        return {"i": self.num_layers, "e": self.num_experts}


TABLE = (
    Row(
        "layers.{i}.experts.{e}.fc.weight",
        ("model.layers.{i}.mlp.experts.{e}.up.weight", "model.layers.{i}.mlp.experts.{e}.gate.weight"),
        "concat",
    ),
    Row("layers.{i}.norm.weight", ("model.layers.{i}.norm.weight",)),
)


def test_rows_repeat_over_every_placeholder_and_round_trip():
    cfg = ExpertConfig()
    hf = {f"model.layers.{i}.mlp.experts.{e}.{n}.weight": torch.randn(2, 3) for i in range(2) for e in range(3) for n in ("up", "gate")}
    hf |= {f"model.layers.{i}.norm.weight": torch.randn(3) for i in range(2)}
    lf = hf_to_lf(TABLE, hf, cfg)
    assert len(lf) == 2 * 3 + 2 and lf["layers.1.experts.2.fc.weight"].shape == (4, 3)
    back = lf_to_hf(TABLE, lf, cfg)
    assert sorted(back) == sorted(hf) and all(torch.equal(back[k], hf[k]) for k in hf)


@dataclass
class LayersOnly:
    num_layers: int = 2

    def repeats(self):
        return {"i": self.num_layers}


def test_a_placeholder_without_a_count_is_named():
    with pytest.raises(ValueError, match=r"\{e\}"):
        hf_to_lf(TABLE, {}, LayersOnly())
    with pytest.raises(ValueError, match=r"\{e\}"):
        hf_to_lf(STACKED, {}, LayersOnly())


# one LoongForge tensor of all a layer's experts from HF's one tensor per expert
STACKED = (Row("layers.{i}.experts.fc1", ("model.layers.{i}.experts.{e}.gate.weight", "model.layers.{i}.experts.{e}.up.weight"), "concat"),)


def test_a_placeholder_only_hf_names_hold_stacks_along_dim_0_and_round_trips():
    cfg = ExpertConfig()
    hf = {f"model.layers.{i}.experts.{e}.{n}.weight": torch.randn(2, 5) for i in range(2) for e in range(3) for n in ("gate", "up")}
    lf = hf_to_lf(STACKED, hf, cfg)
    assert sorted(lf) == ["layers.0.experts.fc1", "layers.1.experts.fc1"] and lf["layers.1.experts.fc1"].shape == (3, 4, 5)
    # expert 2 of layer 1: its gate rows, then its up rows
    want = torch.cat([hf["model.layers.1.experts.2.gate.weight"], hf["model.layers.1.experts.2.up.weight"]])
    assert torch.equal(lf["layers.1.experts.fc1"][2], want)
    back = lf_to_hf(STACKED, lf, cfg)
    assert sorted(back) == sorted(hf) and all(torch.equal(back[k], hf[k]) for k in hf)
    del hf["model.layers.0.experts.1.up.weight"]
    with pytest.raises(UserError, match="experts.1.up.weight"):
        hf_to_lf(STACKED, hf, cfg)


def test_nested_config_section_and_bias_key_from_the_spec(tmp_path):
    cfg = QWEN3.resolve(ModelConfig(family="qwen3"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "some_vlm", "text_config": hf_config_dict(QWEN3, cfg, torch.float32)}))
    fam, got = read_hf_config(tmp_path, {"qwen3": QWEN3, "llama": LLAMA}, section="text_config")
    assert fam is QWEN3 and got.hidden_size == cfg.hidden_size and got.qk_norm
    with pytest.raises(UserError, match="vision_config"):
        read_hf_config(tmp_path, {"qwen3": QWEN3}, section="vision_config")
    # qwen2 always has the q/k/v bias and writes no switch for it; llama writes its own keys
    assert "attention_bias" not in hf_config_dict(QWEN2, QWEN2.resolve(ModelConfig(family="qwen2")), torch.float32)
    d = hf_config_dict(LLAMA, LLAMA.resolve(ModelConfig()), torch.float32)
    assert d["attention_bias"] is False and d["mlp_bias"] is False
