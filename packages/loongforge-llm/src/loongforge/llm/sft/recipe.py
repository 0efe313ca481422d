"""The SFT recipe: conversation data from `loongforge.core.data.text` (packs made in memory, read
from a `data.prepacked` directory or made while training with `data.streaming`) fed to the
setup every LLM recipe shares, with a loss averaged over the whole global batch per token or
per sample (`data.loss_normalization`)."""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Callable, Iterator

import torch
from loongforge.core.data import Pack, rank_micro_batches
from loongforge.core.data.text import PrepackedPacks, make_packs, per_sample_mask, stream_packs, tokenized_samples
from loongforge.core.data.text import pad_id as _pad_id
from loongforge.core.errors import UserError
from loongforge.core.parallel import on_rank0

# ---- the recipe ---------------------------------------------------------------------------


def sft_data(cfg, tok, dp_rank: int, dp_size: int, run_dir: Path, device):
    from loongforge.llm.pretrain import RunData

    d, t = cfg.data, cfg.train
    if d.packing and cfg.parallel.stack != "megatron":
        raise UserError("data.packing=true (THD packs) trains on the megatron stack: set parallel.stack=megatron or data.packing=false")
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
        on_rank0(
            lambda: print(
                f"sft data: streaming, packed within buffers of {d.stream_buffer} samples into {d.seq_length}-token rows", flush=True
            )
        )

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

    def batches(start: int):
        # each micro-batch's loss weights are its tokens' loss mask (token mean) or each
        # sample's tokens summing to 1 (sample mean); the trainer divides by the global sum
        for step, packs in enumerate(global_packs(start), start):
            mbs = []
            for idx in rank_micro_batches(step, t.global_batch_size, t.micro_batch_size, dp_rank, dp_size):
                rows = [packs[i - step * t.global_batch_size] for i in idx]
                masks = [per_sample_mask(p) if d.loss_normalization == "sample" else p.loss_mask for p in rows]
                mb = {
                    "tokens": torch.cat([p.tokens for p in rows]).to(device),
                    "labels": torch.cat([p.labels for p in rows]).to(device),
                    "loss_weights": torch.cat(masks).float().to(device),
                }
                if d.packing:
                    psp = rows[0].packed_seq_params()
                    psp.cu_seqlens_q = psp.cu_seqlens_q.to(device)
                    psp.cu_seqlens_kv = psp.cu_seqlens_kv.to(device)
                    mb["packed_seq_params"] = psp
                mbs.append(mb)
            yield mbs

    return RunData(batches, t.global_batch_size * d.seq_length, t.micro_batch_size)


def run(cfg) -> dict:
    from loongforge.llm.pretrain import train

    return train(cfg, sft_data)
