"""Config schemas of the SFT data section (`data:` of an SFT run config)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


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
    template: Optional[str] = None  # None: the tokenizer's own; or a built-in: llama3, llama3.1, llama3.2, qwen2, qwen3, deepseek_v3, gemma
    template_kwargs: dict = field(
        default_factory=dict
    )  # the template's variables, e.g. {enable_thinking: false}, {date_string: 04 Dec 2026}
    seq_length: int = 512
    packing: bool = True  # best-fit decreasing packs (micro_batch_size must be 1); false: one padded sample per row
    train_on_prompt: bool = False
    last_turn_only: bool = False
    train_on_reasoning: bool = True  # false: no loss on the reasoning (the <think> block) of an assistant turn
    append_eos: bool = (
        False  # add the tokenizer's EOS (trained on) after each sample, for models whose EOS is not the template's end of turn
    )
    on_bad_sample: str = "skip"  # skip | error
    loss_normalization: str = (
        "token"  # token: mean over the global batch's trained tokens; sample: each sample's token mean, averaged over samples
    )
    prepacked: Optional[str] = None  # directory written by `loongforge-llm preprocess --sft` (replaces datasets/template above)
    streaming: bool = False  # tokenize and pack while training instead of before step 1
    stream_buffer: int = 2000  # streaming: samples packed together (and shuffle buffer per dataset)
