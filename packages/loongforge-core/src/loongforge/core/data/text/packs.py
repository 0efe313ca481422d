"""SFT samples and packs in memory: conversation datasets mixed by weight, tokenized with the
chat template (loss on assistant tokens), packed best-fit decreasing into THD packs (or padded
one per row); and the per-sample loss mask for sample-mean loss normalization."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from loongforge.core.data import Pack, best_fit_decreasing, pack_samples, packing_efficiency
from loongforge.core.data.text.files import load_rows
from loongforge.core.data.text.formats import FORMATS
from loongforge.core.data.text.templates import IGNORE, SFTTokenizer
from loongforge.core.errors import UserError

TINY_SFT = Path(__file__).resolve().parent / "assets" / "tiny_sft.jsonl"


def sft_rows(path: str, streaming: bool = False):
    """Rows of one SFT dataset path; `tiny` names the shipped demo set."""
    return load_rows([str(TINY_SFT) if path == "tiny" else path], streaming=streaming)


def sft_tokenizer(d, tok) -> SFTTokenizer:
    return SFTTokenizer(
        tok,
        d.template,
        max_length=d.seq_length + 1,
        train_on_prompt=d.train_on_prompt,
        last_turn_only=d.last_turn_only,
        append_eos=d.append_eos,
        train_on_reasoning=d.train_on_reasoning,
        template_kwargs=d.template_kwargs,
    )


def check_datasets(d) -> None:
    if not d.datasets:
        raise UserError("data.datasets is empty; give at least one {path, format} (or path: tiny)")
    for ds in d.datasets:
        if ds.format not in FORMATS:
            raise UserError(f"data.datasets format {ds.format!r}: choose one of {', '.join(FORMATS)}")
        if ds.weight <= 0:
            raise UserError(f"data.datasets {ds.path}: weight must be positive, got {ds.weight}")


def as_sample(s: dict) -> dict:
    """Tokenized (input_ids, labels) -> next-token sample with a 0/1 loss mask."""
    labels = torch.tensor(s["labels"][1:])
    m = labels != IGNORE
    return {"tokens": torch.tensor(s["input_ids"][:-1]), "labels": torch.where(m, labels, torch.zeros_like(labels)), "loss_mask": m.float()}


def tokenized_samples(d, tok, seed: int, progress: bool = False) -> tuple[list[dict], dict]:
    """All samples of the mixture (each dataset resampled to its weight's share), in a seeded
    order; `progress` shows a bar per dataset."""
    from tqdm import tqdm

    check_datasets(d)
    st = sft_tokenizer(d, tok)
    per_set = []
    for ds in d.datasets:
        rows = sft_rows(ds.path)
        rows = tqdm(rows, total=len(rows), desc=f"tokenize {ds.path}", unit="row", mininterval=1.0, disable=not progress)
        per_set.append([as_sample(s) for s in st.tokenize_rows(rows, ds.format, ds.keys, d.on_bad_sample)])
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


def pad_id(tok) -> int:
    return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id


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
