"""Text pretraining data: tokenize documents (read with `loongforge.core.data.text.load_rows`)
into megatron indexed datasets (`.bin/.idx`), then read blends of them through megatron-core's
GPT dataset."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from loongforge.core.data.text import eod_id, load_rows
from loongforge.core.data.text.files import FILE_FORMATS
from loongforge.core.errors import UserError

TEXT_FORMATS = (".jsonl", ".json", ".csv", ".txt")


def check_not_empty(inputs: list[str]) -> None:
    """A UserError naming the first input file (or data file under an input directory) that is
    empty: no bytes, or a text format with only whitespace. Missing inputs are `load_rows`'s."""
    for item in inputs:
        p = Path(item)
        files = sorted(f for f in p.rglob("*") if f.suffix in FILE_FORMATS and f.is_file()) if p.is_dir() else [p]
        for f in files:
            if not f.is_file():
                continue
            size = f.stat().st_size
            blank = size == 0 or (f.suffix in TEXT_FORMATS and size <= 1 << 16 and not f.read_bytes().strip())
            if blank:
                raise UserError(f"data file is empty: {f}; put documents in it or leave it out of data.corpus / --input")


def has_text(column) -> bool:
    """Whether an arrow column holds a string with more than whitespace (read a chunk at a time,
    stopping at the first such chunk)."""
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        return False
    return any(pc.any(pc.greater(pc.utf8_length(pc.utf8_trim_whitespace(chunk)), 0)).as_py() for chunk in column.chunks)


def preprocess(inputs: list[str], tokenizer, output_prefix: str, text_key: str = "text", workers: int = 1, append_eod: bool = True) -> dict:
    """Tokenize every document of `inputs` into `<output_prefix>.bin/.idx`; returns counts."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from tqdm import tqdm

    out = Path(output_prefix)
    for suffix in (".bin", ".idx"):
        if out.with_suffix(suffix).exists():
            raise UserError(f"{out.with_suffix(suffix)} exists; pick another --output-prefix or remove it")
    check_not_empty(inputs)
    ds = load_rows(inputs)
    if text_key not in ds.column_names:
        raise UserError(f"data has no '{text_key}' column (columns: {', '.join(ds.column_names)}); pass --text-key")
    if not has_text(ds.data.column(text_key)):
        raise UserError(f"no usable text in {', '.join(map(str, inputs))}: every '{text_key}' value is empty, blank, null or not a string")
    eod = eod_id(tokenizer)

    def encode(batch):
        # a row with no text (null) is no document
        texts = batch[text_key]
        present = [t for t in texts if t is not None]
        encoded = iter(tokenizer(present, add_special_tokens=False)["input_ids"] if present else [])
        return {"ids": [[] if t is None else next(encoded) + ([eod] if append_eod else []) for t in texts]}

    ds = ds.map(encode, batched=True, num_proc=workers if workers > 1 else None, remove_columns=ds.column_names, desc="tokenize")
    out.parent.mkdir(parents=True, exist_ok=True)
    dtype = np.int32 if len(tokenizer) > np.iinfo(np.uint16).max + 1 else np.uint16
    tmp_bin, tmp_idx = f"{out}.bin.tmp", f"{out}.idx.tmp"
    n_docs = n_tokens = 0
    try:
        builder = IndexedDatasetBuilder(tmp_bin, dtype=dtype)
        for row in tqdm(ds, desc="write", unit="doc", mininterval=1.0):
            ids = row["ids"]
            if not ids:
                continue
            builder.add_document(torch.tensor(ids, dtype=torch.int64), [len(ids)])
            n_docs += 1
            n_tokens += len(ids)
        builder.finalize(tmp_idx)
    except OSError as e:
        # the partial output goes (it holds the space a full disk needs); a failed write names no file: name the directory
        for tmp in (tmp_bin, tmp_idx):
            with contextlib.suppress(OSError):
                os.remove(tmp)
        if e.filename is None:
            raise OSError(e.errno, e.strerror, str(out.parent)) from e
        raise
    os.replace(tmp_bin, f"{out}.bin")
    os.replace(tmp_idx, f"{out}.idx")
    return {"documents": n_docs, "tokens": n_tokens, "prefix": str(out)}


def parse_blend(data_path: list) -> tuple[list[str], list[float] | None]:
    """Megatron-style blend: [prefix] or [w1, prefix1, w2, prefix2, ...]."""
    items = [str(x) for x in data_path]
    if not items:
        raise UserError("data.data_path is empty; give one or more dataset prefixes (made by `loongforge-llm preprocess`)")
    if len(items) == 1:
        prefixes, weights = items, None
    else:
        if len(items) % 2:
            raise UserError("data.data_path must be [prefix] or [weight, prefix, weight, prefix, ...]")
        try:
            weights = [float(w) for w in items[0::2]]
        except ValueError:
            raise UserError("data.data_path: with several datasets every other entry must be a weight") from None
        prefixes = items[1::2]
    for p in prefixes:
        for suffix in (".bin", ".idx"):
            if not Path(p + suffix).is_file():
                raise UserError(f"dataset file not found: {p}{suffix} (make it with `loongforge-llm preprocess`)")
    return prefixes, weights


def build_gpt_datasets(data_cfg, tokenizer, seed: int, num_samples: list[int], cache_dir: Path):
    """Train/valid/test megatron GPT datasets over the configured blend and split. Every rank
    holds them (megatron's builder writes the index cache on rank 0 first, the others read it)."""
    from loongforge.llm.tokenizer import megatron_tokenizer
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    prefixes, weights = parse_blend(data_cfg.data_path)
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=data_cfg.seq_length,
        blend=(prefixes, weights),
        split=data_cfg.split,
        path_to_cache=str(cache_dir),
        tokenizer=megatron_tokenizer(tokenizer),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        mid_level_dataset_surplus=0.005,
    )
    return BlendedMegatronDatasetBuilder(GPTDataset, num_samples, lambda: True, config).build()
