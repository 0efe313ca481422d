"""The LLM pretraining run config: core's shared sections plus the text data section."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from loongforge.core.config import CheckpointConfig, ParallelConfig, TrainConfig
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

    recipe: str = ""
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    ops: dict = field(default_factory=dict)  # op name -> implementation, e.g. {rms_norm: reference}
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # rank > 0: train LoRA adapters on a frozen checkpoint.load


@dataclass
class PretrainConfig(RunSections):
    recipe: str = "pretrain"
    data: TextDataConfig = field(default_factory=TextDataConfig)


def shipped_config(name: str) -> Path:
    """A config path as given, or the name of one shipped in loongforge.llm.configs."""
    p = Path(name)
    if p.is_file():
        return p
    cand = CONFIG_DIR / (name if name.endswith(".yaml") else name + ".yaml")
    return cand if cand.is_file() else p


@dataclass
class SFTDatasetConfig:
    path: str = ""  # jsonl/json/parquet/arrow/csv file or directory, or "tiny" (shipped demo set)
    format: str = "alpaca"  # alpaca | sharegpt | openai
    weight: float = 1.0
    keys: dict = field(default_factory=dict)  # field-name overrides, e.g. {messages: chat, role: speaker}


@dataclass
class SFTDataConfig:
    datasets: List[SFTDatasetConfig] = field(default_factory=list)
    tokenizer: str = "tiny"
    template: Optional[str] = None  # None: the tokenizer's own; or qwen2, qwen3, qwen3_thinking, llama3
    seq_length: int = 512
    packing: bool = True  # best-fit decreasing packs (micro_batch_size must be 1); false: one padded sample per row
    train_on_prompt: bool = False
    last_turn_only: bool = False
    append_eos: bool = False  # add the tokenizer's EOS (trained on) after each sample, for models whose EOS is not the template's end of turn
    on_bad_sample: str = "skip"  # skip | error
    loss_normalization: str = "token"  # token: mean over the global batch's trained tokens; sample: each sample's token mean, averaged over samples
    prepacked: Optional[str] = None  # directory written by `loongforge-llm preprocess --sft` (replaces datasets/template above)
    streaming: bool = False  # tokenize and pack while training instead of before step 1
    stream_buffer: int = 2000  # streaming: samples packed together (and shuffle buffer per dataset)


@dataclass
class SFTConfig(RunSections):
    recipe: str = "sft"
    data: SFTDataConfig = field(default_factory=SFTDataConfig)


RECIPES = {"pretrain": PretrainConfig, "sft": SFTConfig}
