"""Sequence packing: best-fit decreasing into `seq_length` bins, THD layout with `cu_seqlens`."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch
from loongforge.core.errors import UserError


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Sample indices per bin. Longest first, each into the fullest bin it still fits."""
    if any(n > capacity for n in lengths):
        worst = max(lengths)
        raise UserError(f"a sample of {worst} tokens does not fit seq_length={capacity}; truncate or drop over-long samples first")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (remaining capacity, bin index), sorted
    for i in order:
        n = lengths[i]
        pos = bisect.bisect_left(free, (n, -1))
        if pos < len(free):
            room, b = free.pop(pos)
        else:
            room, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        if room - n > 0:
            bisect.insort(free, (room - n, b))
    return bins


def packing_efficiency(lengths: list[int], bins: list[list[int]], capacity: int) -> float:
    """Real tokens / token slots."""
    return sum(lengths) / (capacity * len(bins)) if bins else 0.0


@dataclass
class Pack:
    tokens: torch.Tensor  # [1, seq_length]
    labels: torch.Tensor  # [1, seq_length]
    loss_mask: torch.Tensor  # [1, seq_length], 0 on padding
    position_ids: torch.Tensor  # [1, seq_length], restarting per sample
    cu_seqlens: torch.Tensor  # [n_segments + 1] int32, padding is its own last segment
    samples: list[int]  # sample indices in pack order

    def packed_seq_params(self):
        from megatron.core.packed_seq_params import PackedSeqParams

        lens = self.cu_seqlens[1:] - self.cu_seqlens[:-1]
        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens,
            cu_seqlens_kv=self.cu_seqlens,
            max_seqlen_q=int(lens.max()),
            max_seqlen_kv=int(lens.max()),
        )


def pack_samples(samples: list[dict], bin_indices: list[int], seq_length: int, pad_id: int, align: int = 1) -> Pack:
    """Concatenate samples (dicts with 1-D `tokens`, `labels`, optional `loss_mask`) into one
    pack. `align` pads every sample to a multiple (context parallel wants 2 * cp_size)."""
    toks, labs, mask, pos, cu = [], [], [], [], [0]
    for i in bin_indices:
        s = samples[i]
        n = s["tokens"].numel()
        pad = (-n) % align
        m = s.get("loss_mask", torch.ones(n))
        toks.append(torch.cat([s["tokens"], torch.full((pad,), pad_id, dtype=s["tokens"].dtype)]))
        labs.append(torch.cat([s["labels"], torch.full((pad,), pad_id, dtype=s["labels"].dtype)]))
        mask.append(torch.cat([m.float(), torch.zeros(pad)]))
        pos.append(torch.arange(n + pad))
        cu.append(cu[-1] + n + pad)
    used = cu[-1]
    if used > seq_length:
        raise UserError(f"pack of {used} tokens exceeds seq_length={seq_length}")
    if used < seq_length:
        rest = seq_length - used
        toks.append(torch.full((rest,), pad_id, dtype=toks[0].dtype))
        labs.append(torch.full((rest,), pad_id, dtype=labs[0].dtype))
        mask.append(torch.zeros(rest))
        pos.append(torch.arange(rest))
        cu.append(seq_length)
    return Pack(
        tokens=torch.cat(toks)[None],
        labels=torch.cat(labs)[None],
        loss_mask=torch.cat(mask)[None],
        position_ids=torch.cat(pos)[None],
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        samples=list(bin_indices),
    )
