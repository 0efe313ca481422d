"""The SFT recipe's data side: conversation datasets mixed by weight, tokenized with the chat
template (loss on assistant tokens), packed best-fit decreasing into THD packs (or padded one
per row), a token-weighted loss over the whole global batch."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from loongforge.core.data import best_fit_decreasing, pack_samples, packing_efficiency
from loongforge.core.errors import UserError
from loongforge.core.parallel import on_rank0
from loongforge.llm.sft.formats import FORMATS
from loongforge.llm.sft.templates import IGNORE, SFTTokenizer

TINY_SFT = Path(__file__).resolve().parents[1] / "assets" / "tiny_sft.jsonl"


def _rows(path: str):
    from loongforge.llm.data import _load_text_dataset

    return _load_text_dataset([str(TINY_SFT) if path == "tiny" else path])


def tokenized_samples(cfg, tok) -> tuple[list[dict], dict]:
    """All samples of the mixture, shifted for next-token training, in a seeded order."""
    d = cfg.data
    if not d.datasets:
        raise UserError("data.datasets is empty; give at least one {path, format} (or path: tiny)")
    st = SFTTokenizer(tok, d.template, max_length=d.seq_length + 1, train_on_prompt=d.train_on_prompt, last_turn_only=d.last_turn_only)
    per_set = []
    for ds in d.datasets:
        if ds.format not in FORMATS:
            raise UserError(f"data.datasets format {ds.format!r}: choose one of {', '.join(FORMATS)}")
        if ds.weight <= 0:
            raise UserError(f"data.datasets {ds.path}: weight must be positive, got {ds.weight}")
        samples = []
        for s in st.tokenize_rows(_rows(ds.path), ds.format, ds.keys, d.on_bad_sample):
            ids, labels = s["input_ids"], s["labels"]
            samples.append({"tokens": torch.tensor(ids[:-1]), "labels": torch.tensor(labels[1:])})
        per_set.append(samples)
    rng = random.Random(cfg.train.seed)
    total = sum(len(s) for s in per_set)
    wsum = sum(ds.weight for ds in d.datasets)
    mixed = []
    for ds, samples in zip(d.datasets, per_set):
        want = max(1, round(total * ds.weight / wsum))
        order = list(range(len(samples)))
        rng.shuffle(order)
        mixed += [samples[order[i % len(order)]] for i in range(want)]
    rng.shuffle(mixed)
    for s in mixed:
        m = s["labels"] != IGNORE
        s["loss_mask"] = m.float()
        s["labels"] = torch.where(m, s["labels"], torch.zeros_like(s["labels"]))
    return mixed, dict(st.stats)


def sft_data(cfg, tok, ctx, run_dir: Path, device):
    from loongforge.llm.pretrain import RunData

    d, t = cfg.data, cfg.train
    if d.packing and t.micro_batch_size != 1:
        raise UserError("data.packing=true packs several samples per row: set train.micro_batch_size=1 (raise data.seq_length instead)")
    samples, stats = tokenized_samples(cfg, tok)
    lengths = [s["tokens"].numel() for s in samples]
    bins = best_fit_decreasing(lengths, d.seq_length) if d.packing else [[i] for i in range(len(samples))]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    packs = [pack_samples(samples, b, d.seq_length, pad_id=pad) for b in bins]
    eff = packing_efficiency(lengths, bins, d.seq_length)
    on_rank0(lambda: print(f"sft data: {len(samples)} samples ({stats}), {len(packs)} {'packs' if d.packing else 'rows'} "
                           f"of {d.seq_length} tokens, packing efficiency {eff:.1%}", flush=True))
    if len(packs) < t.global_batch_size:
        raise UserError(f"only {len(packs)} packs for train.global_batch_size={t.global_batch_size}; add data or lower the batch")
    per_rank = t.global_batch_size // ctx.dp_size
    n_mb = per_rank // t.micro_batch_size
    epoch_orders: dict[int, list[int]] = {}

    def order(epoch: int) -> list[int]:
        if epoch not in epoch_orders:
            o = list(range(len(packs)))
            random.Random(t.seed + epoch).shuffle(o)
            epoch_orders[epoch] = o
        return epoch_orders[epoch]

    def global_batch(step: int) -> list[int]:
        idx = []
        for k in range(step * t.global_batch_size, (step + 1) * t.global_batch_size):
            idx.append(order(k // len(packs))[k % len(packs)])
        return idx

    def batches(start: int):
        step = start
        while True:
            ids = global_batch(step)
            trained = sum(float(packs[i].loss_mask.sum()) for i in ids)
            scale = n_mb * ctx.dp_size / max(trained, 1.0)  # token mean over the global batch
            mine = ids[ctx.dp_rank * per_rank:(ctx.dp_rank + 1) * per_rank]
            mbs = []
            for m in range(n_mb):
                group = [packs[i] for i in mine[m * t.micro_batch_size:(m + 1) * t.micro_batch_size]]
                mb = {
                    "tokens": torch.cat([p.tokens for p in group]).to(device),
                    "labels": torch.cat([p.labels for p in group]).to(device),
                    "loss_mask": torch.cat([p.loss_mask for p in group]).to(device),
                    "loss_scale": scale,
                }
                if d.packing:
                    psp = group[0].packed_seq_params()
                    psp.cu_seqlens_q = psp.cu_seqlens_q.to(device)
                    psp.cu_seqlens_kv = psp.cu_seqlens_kv.to(device)
                    mb["packed_seq_params"] = psp
                mbs.append(mb)
            yield mbs
            step += 1

    def loss_fn(per_token, mb):
        return (per_token.float() * mb["loss_mask"]).sum() * mb["loss_scale"]

    return RunData(batches, loss_fn, t.global_batch_size * d.seq_length, t.micro_batch_size)


def run(cfg) -> dict:
    from loongforge.llm.pretrain import train

    return train(cfg, sft_data)
