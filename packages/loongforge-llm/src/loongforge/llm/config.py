"""The LLM run configs: core's shared sections plus each recipe's data section (pretraining's
here; SFT's schema, `SFTDataConfig`, lives in `loongforge.core.data.text`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from loongforge.core.config import CheckpointConfig, ParallelConfig, TrainConfig
from loongforge.core.data.text import SFTDataConfig, SFTDatasetConfig  # noqa: F401 (SFTDatasetConfig: kept importable from here)
from loongforge.core.foundation.lora import LoRAConfig
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
class RunSections:
    """The sections every LLM recipe's config has; each recipe adds its `data` section."""

    recipe: str = ""  # the qualified recipe name (llm.pretrain, llm.sft); older YAMLs say pretrain / sft
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    ops: dict = field(default_factory=dict)  # op name -> implementation, e.g. {rms_norm: reference}
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # rank > 0: train LoRA adapters on a frozen checkpoint.load


@dataclass
class PretrainConfig(RunSections):
    recipe: str = "llm.pretrain"
    data: TextDataConfig = field(default_factory=TextDataConfig)


@dataclass
class SFTConfig(RunSections):
    recipe: str = "llm.sft"
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
