"""The SFT recipe's data side: conversation datasets mixed by weight, tokenized with the chat
template (loss on assistant tokens), packed best-fit decreasing into THD packs (or padded one
per row), a loss averaged over the whole global batch per token or per sample.

Packs come from one of three sources:
- in memory (default): every row tokenized and packed at start;
- `data.prepacked`: a directory written once by `loongforge-llm preprocess --sft` (parquet,
  memory-mapped);
- `data.streaming`: rows read lazily, tokenized as training consumes them and packed within a
  buffer of `data.stream_buffer` samples (no pass over the data before step 1).
"""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterator

import torch

from loongforge.core.data import Pack, best_fit_decreasing, pack_samples, packing_efficiency
from loongforge.core.errors import UserError
from loongforge.core.parallel import on_rank0
from loongforge.llm.sft.formats import FORMATS
from loongforge.llm.sft.templates import IGNORE, SFTTokenizer

TINY_SFT = Path(__file__).resolve().parents[1] / "assets" / "tiny_sft.jsonl"
PREPACKED_META = "loongforge_sft.json"
PREPACKED_VERSION = 1


def _rows(path: str, streaming: bool = False):
    from loongforge.llm.data import _load_text_dataset

    return _load_text_dataset([str(TINY_SFT) if path == "tiny" else path], streaming=streaming)


def sft_tokenizer(d, tok) -> SFTTokenizer:
    return SFTTokenizer(tok, d.template, max_length=d.seq_length + 1, train_on_prompt=d.train_on_prompt,
                        last_turn_only=d.last_turn_only, append_eos=d.append_eos)


def _check_datasets(d) -> None:
    if not d.datasets:
        raise UserError("data.datasets is empty; give at least one {path, format} (or path: tiny)")
    for ds in d.datasets:
        if ds.format not in FORMATS:
            raise UserError(f"data.datasets format {ds.format!r}: choose one of {', '.join(FORMATS)}")
        if ds.weight <= 0:
            raise UserError(f"data.datasets {ds.path}: weight must be positive, got {ds.weight}")


def _as_sample(s: dict) -> dict:
    """Tokenized (input_ids, labels) -> next-token sample with a 0/1 loss mask."""
    labels = torch.tensor(s["labels"][1:])
    m = labels != IGNORE
    return {"tokens": torch.tensor(s["input_ids"][:-1]), "labels": torch.where(m, labels, torch.zeros_like(labels)), "loss_mask": m.float()}


def tokenized_samples(d, tok, seed: int, progress: bool = False) -> tuple[list[dict], dict]:
    """All samples of the mixture (each dataset resampled to its weight's share), in a seeded
    order; `progress` shows a bar per dataset."""
    from tqdm import tqdm

    _check_datasets(d)
    st = sft_tokenizer(d, tok)
    per_set = []
    for ds in d.datasets:
        rows = _rows(ds.path)
        rows = tqdm(rows, total=len(rows), desc=f"tokenize {ds.path}", unit="row", mininterval=1.0, disable=not progress)
        per_set.append([_as_sample(s) for s in st.tokenize_rows(rows, ds.format, ds.keys, d.on_bad_sample)])
    rng = random.Random(seed)
    total = sum(len(s) for s in per_set)
    wsum = sum(ds.weight for ds in d.datasets)
    mixed = []
    for ds, samples in zip(d.datasets, per_set):
        want = max(1, round(total * ds.weight / wsum))
        order = list(range(len(samples)))
        rng.shuffle(order)
        mixed += [samples[order[i % len(order)]] for i in range(want)]
    rng.shuffle(mixed)
    return mixed, dict(st.stats)


def make_packs(samples: list[dict], d, pad_id: int) -> tuple[list[Pack], float]:
    lengths = [s["tokens"].numel() for s in samples]
    bins = best_fit_decreasing(lengths, d.seq_length) if d.packing else [[i] for i in range(len(samples))]
    return [pack_samples(samples, b, d.seq_length, pad_id=pad_id) for b in bins], packing_efficiency(lengths, bins, d.seq_length)


def _pad_id(tok) -> int:
    return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id


# ---- offline: preprocess --sft ------------------------------------------------------------

def write_prepacked(d, tok, out_dir, seed: int = 1234) -> dict:
    """Tokenize and pack `d` (an SFTDataConfig) once into parquet shards under `out_dir`, with
    a metadata file that training checks against its own config."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tqdm import tqdm

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out}: output directory exists and is not empty; choose a new one")
    samples, stats = tokenized_samples(d, tok, seed, progress=True)
    packs, eff = make_packs(samples, d, _pad_id(tok))
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    rows_per_shard = max(1, (256 << 20) // (d.seq_length * 13))  # ~256 MB of int32/int32/float32 per shard
    for n, start in enumerate(tqdm(range(0, len(packs), rows_per_shard), desc="write", unit="shard", mininterval=1.0)):
        chunk = packs[start:start + rows_per_shard]
        table = pa.table({
            "tokens": [p.tokens[0].to(torch.int32).tolist() for p in chunk],
            "labels": [p.labels[0].to(torch.int32).tolist() for p in chunk],
            "loss_mask": [p.loss_mask[0].tolist() for p in chunk],
            "cu_seqlens": [p.cu_seqlens.tolist() for p in chunk],
        })
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
            raise UserError(f"data.prepacked={path}: format version {self.meta.get('version')} is not {PREPACKED_VERSION}; preprocess again")
        if self.meta["seq_length"] != seq_length:
            raise UserError(f"data.prepacked={path} was packed for seq_length={self.meta['seq_length']}, the config has data.seq_length={seq_length}")
        if self.meta["packing"] != packing:
            raise UserError(f"data.prepacked={path} was written with packing={self.meta['packing']}; set data.packing={str(self.meta['packing']).lower()}")
        if self.meta["tokenizer_size"] != tokenizer_size:
            raise UserError(f"data.prepacked={path} was tokenized with a {self.meta['tokenizer_size']}-token tokenizer, data.tokenizer has {tokenizer_size}")
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

        return Pack(tokens=r["tokens"].long()[None], labels=r["labels"].long()[None], loss_mask=r["loss_mask"].float()[None],
                    position_ids=positions_from_cu_seqlens(cu, cu[-1].item())[None], cu_seqlens=cu, samples=[])


# ---- streaming ----------------------------------------------------------------------------

def stream_packs(d, tok, seed: int) -> Iterator[Pack]:
    """Packs made as they are needed: rows drawn from the datasets by weight (each read lazily,
    shuffled in a buffer, restarting with a new order when it runs out), tokenized, and packed
    best-fit decreasing within every `stream_buffer` samples. Deterministic for a seed."""
    _check_datasets(d)
    st = sft_tokenizer(d, tok)
    rng = random.Random(seed)

    def endless(ds, k):
        for epoch in itertools.count():
            rows = _rows(ds.path, streaming=True).shuffle(seed=seed + 1000 * k + epoch, buffer_size=max(d.stream_buffer, 1))
            got = 0
            for s in st.tokenize_rows(rows, ds.format, ds.keys, d.on_bad_sample, require_trained=False):
                got += 1
                yield _as_sample(s)
            if got == 0:
                raise UserError(f"data.datasets {ds.path}: no usable rows (bad rows: {dict(st.stats)})")

    sources = [endless(ds, k) for k, ds in enumerate(d.datasets)]
    weights = [ds.weight for ds in d.datasets]
    pad = _pad_id(tok)
    trained_any = False
    while True:
        buf = [next(sources[rng.choices(range(len(sources)), weights)[0]]) for _ in range(d.stream_buffer)]
        trained_any = trained_any or any(bool(s["loss_mask"].any()) for s in buf)
        if not trained_any:
            raise UserError(f"no sample in the first {d.stream_buffer} streamed rows has a token to train on (all labels masked); bad rows: {dict(st.stats)}")
        packs, _ = make_packs(buf, d, pad)
        rng.shuffle(packs)
        yield from packs


# ---- the recipe ---------------------------------------------------------------------------

def per_sample_mask(pack: Pack) -> torch.Tensor:
    """The pack's loss mask with every sample's trained tokens summing to 1 (token mean within
    each sample; samples then count equally)."""
    mask = pack.loss_mask.clone()
    cu = pack.cu_seqlens.tolist()
    for a, b in zip(cu[:-1], cu[1:]):
        n = float(mask[0, a:b].sum())
        if n > 0:
            mask[0, a:b] /= n
    return mask


def sft_data(cfg, tok, ctx, run_dir: Path, device):
    from loongforge.llm.pretrain import RunData

    d, t = cfg.data, cfg.train
    if d.packing and t.micro_batch_size != 1:
        raise UserError("data.packing=true packs several samples per row: set train.micro_batch_size=1 (raise data.seq_length instead)")
    if d.loss_normalization not in ("token", "sample"):
        raise UserError(f"data.loss_normalization={d.loss_normalization!r}: choose token or sample")
    if d.prepacked and d.streaming:
        raise UserError("data.prepacked and data.streaming exclude each other: pick one")
    if d.streaming and d.stream_buffer < t.global_batch_size:
        raise UserError(f"data.stream_buffer={d.stream_buffer} must hold at least train.global_batch_size={t.global_batch_size} samples")

    global_packs: Callable[[int], Iterator[list[Pack]]]
    if d.streaming:
        on_rank0(lambda: print(f"sft data: streaming, packed within buffers of {d.stream_buffer} samples into {d.seq_length}-token rows", flush=True))

        def global_packs(start):
            packs = stream_packs(d, tok, t.seed)
            for _ in range(start * t.global_batch_size):  # a resumed run skips what was trained on
                next(packs)
            while True:
                yield [next(packs) for _ in range(t.global_batch_size)]
    else:
        if d.prepacked:
            source = PrepackedPacks(d.prepacked, d.seq_length, d.packing, len(tok))
            m = source.meta
            desc = f"{m['samples']} samples from {d.prepacked}, {len(source)} packs, packing efficiency {m['packing_efficiency']:.1%}"
        else:
            samples, stats = tokenized_samples(d, tok, t.seed)
            source, eff = make_packs(samples, d, _pad_id(tok))
            desc = f"{len(samples)} samples ({stats}), {len(source)} {'packs' if d.packing else 'rows'}, packing efficiency {eff:.1%}"
        on_rank0(lambda: print(f"sft data: {desc} of {d.seq_length} tokens", flush=True))
        if len(source) < t.global_batch_size:
            raise UserError(f"only {len(source)} packs for train.global_batch_size={t.global_batch_size}; add data or lower the batch")
        epoch_orders: dict[int, list[int]] = {}

        def order(epoch: int) -> list[int]:
            if epoch not in epoch_orders:
                o = list(range(len(source)))
                random.Random(t.seed + epoch).shuffle(o)
                epoch_orders[epoch] = o
            return epoch_orders[epoch]

        def global_packs(start):
            for step in itertools.count(start):
                ks = range(step * t.global_batch_size, (step + 1) * t.global_batch_size)
                yield [source[order(k // len(source))[k % len(source)]] for k in ks]

    per_rank = t.global_batch_size // ctx.dp_size
    n_mb = per_rank // t.micro_batch_size

    def batches(start: int):
        for packs in global_packs(start):
            masks = [per_sample_mask(p) if d.loss_normalization == "sample" else p.loss_mask for p in packs]
            trained = sum(float(m.sum()) for m in masks)  # tokens, or samples with a trained token
            scale = n_mb * ctx.dp_size / max(trained, 1e-9)  # mean over the global batch
            lo = ctx.dp_rank * per_rank
            mbs = []
            for k in range(n_mb):
                idx = range(lo + k * t.micro_batch_size, lo + (k + 1) * t.micro_batch_size)
                mb = {
                    "tokens": torch.cat([packs[i].tokens for i in idx]).to(device),
                    "labels": torch.cat([packs[i].labels for i in idx]).to(device),
                    "loss_weights": (torch.cat([masks[i] for i in idx]) * scale).to(device),
                }
                if d.packing:
                    psp = packs[idx[0]].packed_seq_params()
                    psp.cu_seqlens_q = psp.cu_seqlens_q.to(device)
                    psp.cu_seqlens_kv = psp.cu_seqlens_kv.to(device)
                    mb["packed_seq_params"] = psp
                mbs.append(mb)
            yield mbs

    return RunData(batches, t.global_batch_size * d.seq_length, t.micro_batch_size)


def run(cfg) -> dict:
    from loongforge.llm.pretrain import train

    return train(cfg, sft_data)
