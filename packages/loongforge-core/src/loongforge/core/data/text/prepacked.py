"""SFT packs written once by `loongforge-llm preprocess --sft` (parquet shards plus a metadata
file that training checks against its own config), and read back memory-mapped."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
from loongforge.core.data import Pack
from loongforge.core.data.text.packs import make_packs, pad_id, tokenized_samples
from loongforge.core.errors import UserError
from loongforge.core.outputs import require_new_dir

PREPACKED_META = "loongforge_sft.json"
PREPACKED_VERSION = 1


def write_prepacked(d, tok, out_dir, seed: int = 1234) -> dict:
    """Tokenize and pack `d` (an SFTDataConfig) once into parquet shards under `out_dir`, with
    a metadata file that training checks against its own config."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tqdm import tqdm

    out = require_new_dir(out_dir)
    samples, stats = tokenized_samples(d, tok, seed, progress=True)
    packs, eff = make_packs(samples, d, pad_id(tok))
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    rows_per_shard = max(1, (256 << 20) // (d.seq_length * 13))  # ~256 MB of int32/int32/float32 per shard
    for n, start in enumerate(tqdm(range(0, len(packs), rows_per_shard), desc="write", unit="shard", mininterval=1.0)):
        chunk = packs[start : start + rows_per_shard]
        table = pa.table(
            {
                "tokens": [p.tokens[0].to(torch.int32).tolist() for p in chunk],
                "labels": [p.labels[0].to(torch.int32).tolist() for p in chunk],
                "loss_mask": [p.loss_mask[0].tolist() for p in chunk],
                "cu_seqlens": [p.cu_seqlens.tolist() for p in chunk],
            }
        )
        pq.write_table(table, tmp / f"packs-{n:05d}.parquet")
    meta = {
        "version": PREPACKED_VERSION,
        "seq_length": d.seq_length,
        "packing": d.packing,
        "packs": len(packs),
        "samples": len(samples),
        "tokens": int(sum(s["tokens"].numel() for s in samples)),
        "packing_efficiency": eff,
        "rows": stats,
        "data": asdict(d),
        "tokenizer_size": len(tok),
    }
    (tmp / PREPACKED_META).write_text(json.dumps(meta, indent=1))
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    return {k: meta[k] for k in ("packs", "samples", "tokens", "packing_efficiency", "rows")} | {"output_dir": str(out)}


class PrepackedPacks:
    """Packs read on demand from a `preprocess --sft` directory (parquet, memory-mapped)."""

    def __init__(self, path, seq_length: int, packing: bool, tokenizer_size: int):
        import datasets

        root = Path(path)
        meta_path = root / PREPACKED_META
        if not meta_path.is_file():
            raise UserError(f"data.prepacked={path}: not a `loongforge-llm preprocess --sft` output (no {PREPACKED_META})")
        self.meta = json.loads(meta_path.read_text())
        if self.meta.get("version") != PREPACKED_VERSION:
            raise UserError(
                f"data.prepacked={path}: format version {self.meta.get('version')} is not {PREPACKED_VERSION}; preprocess again"
            )
        if self.meta["seq_length"] != seq_length:
            raise UserError(
                f"data.prepacked={path} was packed for seq_length={self.meta['seq_length']}, the config has data.seq_length={seq_length}"
            )
        if self.meta["packing"] != packing:
            raise UserError(
                f"data.prepacked={path} was written with packing={self.meta['packing']}; set data.packing={str(self.meta['packing']).lower()}"
            )
        if self.meta["tokenizer_size"] != tokenizer_size:
            raise UserError(
                f"data.prepacked={path} was tokenized with a {self.meta['tokenizer_size']}-token tokenizer, data.tokenizer has {tokenizer_size}"
            )
        files = sorted(str(f) for f in root.glob("packs-*.parquet"))
        datasets.disable_progress_bars()
        try:
            self.table = datasets.load_dataset("parquet", data_files=files, split="train").with_format("torch")
        finally:
            datasets.enable_progress_bars()
        if len(self.table) != self.meta["packs"]:
            raise UserError(f"data.prepacked={path}: {len(self.table)} packs on disk, metadata says {self.meta['packs']}; preprocess again")

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, i: int) -> Pack:
        r = self.table[int(i)]
        cu = r["cu_seqlens"].to(torch.int32)
        from loongforge.core.ops.reference import positions_from_cu_seqlens

        return Pack(
            tokens=r["tokens"].long()[None],
            labels=r["labels"].long()[None],
            loss_mask=r["loss_mask"].float()[None],
            position_ids=positions_from_cu_seqlens(cu, cu[-1].item())[None],
            cu_seqlens=cu,
            samples=[],
        )
