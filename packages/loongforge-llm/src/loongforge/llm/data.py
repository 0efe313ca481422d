"""Text pretraining data: tokenize documents into megatron indexed datasets (`.bin/.idx`),
then read blends of them through megatron-core's GPT dataset."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from loongforge.core.errors import UserError
from loongforge.llm.tokenizer import eod_id

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".txt": "text"}


def _load_text_dataset(inputs: list[str], streaming: bool = False):
    """Rows of local jsonl/json/parquet/arrow/csv/txt files or directories of them, through
    `datasets` (memory-mapped; `streaming` reads them lazily instead)."""
    import datasets

    files: list[str] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            files += sorted(str(f) for f in p.rglob("*") if f.suffix in FORMATS)
        elif p.is_file():
            files.append(str(p))
        else:
            raise UserError(f"data input not found: {item}")
    if not files:
        raise UserError(f"no data files (.jsonl/.json/.parquet/.arrow/.csv/.txt) under {', '.join(inputs)}")
    kinds = {FORMATS.get(Path(f).suffix) for f in files}
    if None in kinds or len(kinds) != 1:
        raise UserError(f"data files must share one supported format ({', '.join(FORMATS)}); got {sorted(map(str, kinds))}")
    # Reading files shows no bars (an error right after stays one line); tokenizing shows one.
    datasets.disable_progress_bars()
    try:
        return datasets.load_dataset(kinds.pop(), data_files=files, split="train", streaming=streaming)
    finally:
        datasets.enable_progress_bars()


def preprocess(inputs: list[str], tokenizer, output_prefix: str, text_key: str = "text", workers: int = 1, append_eod: bool = True) -> dict:
    """Tokenize every document of `inputs` into `<output_prefix>.bin/.idx`; returns counts."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from tqdm import tqdm

    out = Path(output_prefix)
    for suffix in (".bin", ".idx"):
        if out.with_suffix(suffix).exists():
            raise UserError(f"{out.with_suffix(suffix)} exists; pick another --output-prefix or remove it")
    ds = _load_text_dataset(inputs)
    if text_key not in ds.column_names:
        raise UserError(f"data has no '{text_key}' column (columns: {', '.join(ds.column_names)}); pass --text-key")
    eod = eod_id(tokenizer)

    def encode(batch):
        ids = tokenizer(batch[text_key], add_special_tokens=False)["input_ids"]
        return {"ids": [x + [eod] if append_eod else x for x in ids]}

    ds = ds.map(encode, batched=True, num_proc=workers if workers > 1 else None, remove_columns=ds.column_names, desc="tokenize")
    out.parent.mkdir(parents=True, exist_ok=True)
    dtype = np.int32 if len(tokenizer) > np.iinfo(np.uint16).max + 1 else np.uint16
    tmp_bin, tmp_idx = f"{out}.bin.tmp", f"{out}.idx.tmp"
    builder = IndexedDatasetBuilder(tmp_bin, dtype=dtype)
    n_tokens = 0
    for row in tqdm(ds, desc="write", unit="doc", mininterval=1.0):
        ids = row["ids"]
        if not ids:
            continue
        builder.add_document(torch.tensor(ids, dtype=torch.int64), [len(ids)])
        n_tokens += len(ids)
    builder.finalize(tmp_idx)
    os.replace(tmp_bin, f"{out}.bin")
    os.replace(tmp_idx, f"{out}.idx")
    return {"documents": len(ds), "tokens": n_tokens, "prefix": str(out)}


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
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    from loongforge.llm.tokenizer import megatron_tokenizer

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


def step_batches(dataset, start_step: int, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int, device) -> Iterator[list[dict]]:
    """Micro-batches of each global step for this data-parallel rank; sample order depends only on
    the step, so a resumed run reads what the uninterrupted one would have."""
    per_rank = global_batch // dp_size
    step = start_step
    while True:
        base = step * global_batch + dp_rank * per_rank
        mbs = []
        for m in range(per_rank // micro_batch):
            idx = [base + m * micro_batch + i for i in range(micro_batch)]
            samples = [dataset[i % len(dataset)] for i in idx]
            mbs.append(
                {
                    "tokens": torch.stack([s["tokens"] for s in samples]).to(device),
                    "labels": torch.stack([s["labels"] for s in samples]).to(device),
                    "loss_mask": torch.stack([s["loss_mask"] for s in samples]).to(device),
                }
            )
        yield mbs
        step += 1
