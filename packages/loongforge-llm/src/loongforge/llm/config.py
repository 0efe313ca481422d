"""The LLM pretraining run config: core's shared sections plus the text data section."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from loongforge.core.config import CheckpointConfig, ParallelConfig, TrainConfig
from loongforge.core.foundation.spec import ModelConfig

CONFIG_DIR = Path(__file__).parent / "configs"


@dataclass
class TextDataConfig:
    data_path: list = field(default_factory=list)  # [prefix] or [weight, prefix, weight, prefix, ...]
    split: str = "98,2,0"  # train,valid,test proportions
    seq_length: int = 128
    tokenizer: str = "tiny"  # HF tokenizer directory, or "tiny" (shipped demo tokenizer)
    corpus: list = field(default_factory=list)  # raw text files; preprocessed into run_dir/data when data_path is empty


@dataclass
class PretrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: TextDataConfig = field(default_factory=TextDataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    ops: dict = field(default_factory=dict)  # op name -> implementation, e.g. {rms_norm: reference}


def shipped_config(name: str) -> Path:
    """A config path as given, or the name of one shipped in loongforge.llm.configs."""
    p = Path(name)
    if p.is_file():
        return p
    cand = CONFIG_DIR / (name if name.endswith(".yaml") else name + ".yaml")
    return cand if cand.is_file() else p
