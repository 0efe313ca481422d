"""Text data shared by every stack that reads text (LLM, VLM): HF tokenizers (and the shipped
`tiny` demo tokenizer), rows of local data files, SFT conversation formats, chat templates with
assistant-token loss masks, and SFT packs made in memory, prepacked to parquet by
`loongforge-llm preprocess --sft`, or streamed while training.

Modules: `tokenizer`, `files`, `formats`, `templates`, `config` (the SFT data section's schema),
`packs` (tokenize + pack in memory), `prepacked`, `streaming`. transformers, datasets and pyarrow
are imported only inside the functions that use them.
"""

from loongforge.core.data.text.config import SFTDataConfig, SFTDatasetConfig
from loongforge.core.data.text.files import FILE_FORMATS, load_rows
from loongforge.core.data.text.formats import FORMATS, ROLES, BadSample, to_messages
from loongforge.core.data.text.packs import (
    TINY_SFT,
    as_sample,
    check_datasets,
    make_packs,
    pad_id,
    per_sample_mask,
    sft_rows,
    sft_tokenizer,
    tokenized_samples,
)
from loongforge.core.data.text.prepacked import PREPACKED_META, PREPACKED_VERSION, PrepackedPacks, write_prepacked
from loongforge.core.data.text.streaming import stream_packs
from loongforge.core.data.text.templates import BUILTIN_TEMPLATES, IGNORE, SFTTokenizer
from loongforge.core.data.text.tokenizer import (
    TINY_TOKENIZER,
    copy_tokenizer,
    eod_id,
    load_tokenizer,
    resolve_tokenizer_path,
    tokenizer_dir_for,
)

__all__ = [
    "SFTDataConfig",
    "SFTDatasetConfig",
    "FILE_FORMATS",
    "load_rows",
    "FORMATS",
    "ROLES",
    "BadSample",
    "to_messages",
    "TINY_SFT",
    "as_sample",
    "check_datasets",
    "make_packs",
    "pad_id",
    "per_sample_mask",
    "sft_rows",
    "sft_tokenizer",
    "tokenized_samples",
    "PREPACKED_META",
    "PREPACKED_VERSION",
    "PrepackedPacks",
    "write_prepacked",
    "stream_packs",
    "BUILTIN_TEMPLATES",
    "IGNORE",
    "SFTTokenizer",
    "TINY_TOKENIZER",
    "copy_tokenizer",
    "eod_id",
    "load_tokenizer",
    "resolve_tokenizer_path",
    "tokenizer_dir_for",
]
