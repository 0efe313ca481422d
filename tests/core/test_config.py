"""Config composition, overrides and strict validation; LR schedules; the registry."""

from dataclasses import dataclass, field

import pytest
from loongforge.core.config import CheckpointConfig, TrainConfig, load_config
from loongforge.core.errors import UserError
from loongforge.core.foundation.spec import ModelConfig
from loongforge.core.train.lr import lr_at


@dataclass
class Run:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    ops: dict = field(default_factory=dict)


def test_yaml_defaults_and_overrides(tmp_path):
    (tmp_path / "base.yaml").write_text("model:\n  num_layers: 3\n  hidden_size: 96\ntrain:\n  lr: 1.0e-3\n")
    (tmp_path / "run.yaml").write_text("defaults: [base.yaml]\nmodel:\n  hidden_size: 128\n")
    cfg = load_config(
        Run, tmp_path / "run.yaml", ["train.lr=5e-4", "model.rope_scaling={rope_type: llama3, factor: 8}", "ops.rms_norm=reference"]
    )
    assert cfg.model.num_layers == 3 and cfg.model.hidden_size == 128
    assert cfg.train.lr == 5e-4
    assert cfg.model.rope_scaling == {"rope_type": "llama3", "factor": 8}
    assert cfg.ops == {"rms_norm": "reference"}


def test_unknown_key_names_path_and_closest():
    with pytest.raises(UserError, match=r"unknown config key 'train.lrr'; did you mean 'train.lr'\?"):
        load_config(Run, None, ["train.lrr=1"])
    with pytest.raises(UserError, match=r"unknown config key 'modle'; did you mean 'model'\?"):
        load_config(Run, None, ["modle.num_layers=1"])


def test_unknown_key_in_yaml(tmp_path):
    (tmp_path / "r.yaml").write_text("train:\n  micro_batch: 2\n")
    with pytest.raises(UserError, match="train.micro_batch'; did you mean 'train.micro_batch_size'"):
        load_config(Run, tmp_path / "r.yaml")


def test_wrong_type_names_expected_type():
    with pytest.raises(UserError, match=r"train.lr.*could not be converted to Float"):
        load_config(Run, None, ["train.lr=fast"])
    with pytest.raises(UserError, match=r"model.num_layers.*Integer"):
        load_config(Run, None, ["model.num_layers=1.5"])


def test_missing_file_and_bad_override():
    with pytest.raises(UserError, match="config file not found"):
        load_config(Run, "nope.yaml")
    with pytest.raises(UserError, match="not key=value"):
        load_config(Run, None, ["train.lr"])


def _t(**kw):
    return TrainConfig(**{"lr": 1.0, "min_lr": 0.1, "lr_warmup_iters": 10, "train_iters": 110, **kw})


def test_lr_warmup_cosine():
    c = _t()
    assert lr_at(0, c) == pytest.approx(0.1)
    assert lr_at(9, c) == pytest.approx(1.0)
    assert lr_at(60, c) == pytest.approx(0.55)  # halfway through the cosine
    assert lr_at(110, c) == pytest.approx(0.1)


def test_lr_wsd_and_linear():
    c = _t(lr_decay_style="wsd", lr_wsd_decay_iters=20)
    assert lr_at(50, c) == 1.0 and lr_at(89, c) == 1.0
    assert lr_at(100, c) == pytest.approx(0.55)
    assert lr_at(110, c) == pytest.approx(0.1)
    assert lr_at(60, _t(lr_decay_style="linear")) == pytest.approx(0.55)
    with pytest.raises(UserError, match="lr_decay_style"):
        lr_at(20, _t(lr_decay_style="step"))


def test_registry_from_entry_points():
    from loongforge.core.registry import registry

    reg = registry()
    assert {"llama", "qwen2", "qwen3"} <= set(reg.names("family"))
    assert {"cpu", "cuda"} <= set(reg.names("accelerator"))
    assert "llm.pretrain" in reg.names("recipe")  # registered by loongforge-llm's entry point
    with pytest.raises(UserError, match="did you mean 'llama'"):
        reg.get("family", "lama")
