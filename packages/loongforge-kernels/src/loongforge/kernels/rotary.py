"""Rotary embedding with the angles given as tables (core op `rotary`) in Triton: each token's cos /
sin per channel pair, broadcast over the heads; half-split pairs (c, c + rot/2) or interleaved
pairs (2c, 2c + 1); partial rotary (the channels past 2 * rot/2 are copied). Multi-axis RoPE
(Qwen2.5-VL's vision tower and M-RoPE, Wan's video axes) is this op with tables the model builds.

Queries and keys are rotated in one launch, with `rope`'s layout of work (its helpers, its block of
16 q heads and the same block of k heads of one token per program, 2 warps): q and k are read once
and written once, the token's cos / sin rows are loaded once per program, after the q / k loads are
issued, and the rotation is computed in fp32. The backward is the same kernel on the output
gradients with the negative angle (sin -> -sin). The tables get no gradient (they are constants of
the positions); where one requires grad, the reference runs.

Any leading dims: q / k [..., heads, head_dim] run as [tokens, heads, head_dim] views with their
own token and head strides (the vision tower's q / k are strided views of its fused projection,
read in place); a copy is made only where the token dims do not merge into one stride (`reshape`)
or the channels are not unit-stride (`contiguous`), and likewise for the tables ([tokens, rot/2]).
The outputs are new contiguous tensors of q's and k's shapes.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from loongforge.core.ops import reference
from loongforge.kernels._util import KERNEL_DTYPES
from loongforge.kernels.rope import BLOCK_H, WARPS, Rotation, _copy_unrotated, _load_pairs, _store_rotated, pair_channels


@triton.jit
def _rotary(
    Q,
    K,
    QO,
    KO,
    COS,
    SIN,
    sqt,
    sqh,
    skt,
    skh,
    sct,
    sst,
    HQ,
    HK,
    D,
    HALF,
    NBLOCKS,
    SIGN: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_PASS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program tok * NBLOCKS + j rotates q heads and k heads [j*BLOCK_H, (j+1)*BLOCK_H) of token
    `tok` by the token's cos / sin row. Outputs are contiguous [tokens, heads, D]."""
    pid = tl.program_id(0)
    tok = (pid // NBLOCKS).to(tl.int64)
    h = (pid % NBLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    c1, c2, im = pair_channels(HALF, INTERLEAVED, BLOCK_HALF)
    qb, kb = Q + tok * sqt, K + tok * skt
    qob, kob = QO + tok * (HQ * D), KO + tok * (HK * D)
    q1, q2 = _load_pairs(qb, h, HQ, sqh, c1, c2, im)
    k1, k2 = _load_pairs(kb, h, HK, skh, c1, c2, im)
    i = tl.arange(0, BLOCK_HALF)
    cos = tl.load(COS + tok * sct + i, mask=i < HALF, other=1.0).to(tl.float32)[None, :]
    sin = (tl.load(SIN + tok * sst + i, mask=i < HALF, other=0.0).to(tl.float32) * SIGN)[None, :]
    _store_rotated(qob, h, HQ, D, c1, c2, im, q1, q2, cos, sin)
    _store_rotated(kob, h, HK, D, c1, c2, im, k1, k2, cos, sin)
    if HAS_PASS:
        _copy_unrotated(qb, qob, h, HQ, sqh, D, D, HALF, BLOCK_D)
        _copy_unrotated(kb, kob, h, HK, skh, D, D, HALF, BLOCK_D)


def _heads_view(x: torch.Tensor) -> torch.Tensor:
    """x [..., heads, d] as [tokens, heads, d] with unit-stride channels: a view where the token
    dims merge into one stride (`reshape`), else a copy; a copy too where the channels are strided."""
    x = x.reshape(math.prod(x.shape[:-2]), x.shape[-2], x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
    sign: float,
    block_h: int = BLOCK_H,
    num_warps: int = WARPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [..., hq, d] and k [..., hk, d] (the same leading dims) rotated by cos / sin [tokens, rot/2]
    (unit-stride rows) into new contiguous tensors of their shapes. Program j of a token rotates q
    heads and k heads [j*block_h, (j+1)*block_h), the head blocks of a token neighbouring programs
    (`rope._launch` says why, with its measurements)."""
    q3, k3 = _heads_view(q), _heads_view(k)
    t, hq, d = q3.shape
    hk = k3.shape[1]
    half = cos.shape[-1]
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ko = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    heads = max(hq, hk)
    block_h = min(block_h, triton.next_power_of_2(heads))
    nblocks = triton.cdiv(heads, block_h)
    if t * heads:
        _rotary[(t * nblocks,)](
            q3,
            k3,
            qo,
            ko,
            cos,
            sin,
            q3.stride(0),
            q3.stride(1),
            k3.stride(0),
            k3.stride(1),
            cos.stride(0),
            sin.stride(0),
            hq,
            hk,
            d,
            half,
            nblocks,
            SIGN=sign,
            INTERLEAVED=interleaved,
            HAS_PASS=2 * half < d,
            BLOCK_H=block_h,
            BLOCK_HALF=triton.next_power_of_2(half),
            BLOCK_D=triton.next_power_of_2(d),
            num_warps=num_warps,
        )
    return qo, ko


def _runs_here(t: torch.Tensor) -> bool:
    """CUDA tensors; CPU tensors only under the Triton interpreter (the CPU tests)."""
    return t.is_cuda or (t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def per_token_tables(table: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether `table` [..., 1, rot/2] holds one row per token of q [..., heads, d]: its leading
    dims, right-aligned, are q's token dims, and any of q's token dims it lacks are 1 (so the
    reference's broadcast neither repeats a row nor grows the output)."""
    lead, rows = q.shape[:-2], table.shape[:-2]
    if table.dim() < 2 or table.shape[-2] != 1 or len(rows) > len(lead):
        return False
    return tuple(lead) == (1,) * (len(lead) - len(rows)) + tuple(rows)


def _supported(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    half = cos.shape[-1] if cos.dim() else 0
    return (
        q.dtype in KERNEL_DTYPES
        and k.dtype == q.dtype
        and cos.dtype in KERNEL_DTYPES
        and sin.dtype in KERNEL_DTYPES
        and _runs_here(q)
        and k.device == q.device == cos.device == sin.device
        and q.dim() >= 3
        and k.shape[:-2] == q.shape[:-2]
        and k.shape[-1] == q.shape[-1]
        and cos.shape == sin.shape
        and per_token_tables(cos, q)
        and 0 < 2 * half <= q.shape[-1]
        and not (torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad))
    )


def _table_rows(table: torch.Tensor) -> torch.Tensor:
    """A per-token table [..., 1, rot/2] as [tokens, rot/2] with unit-stride rows (a view where it
    can be)."""
    table = table.reshape(-1, table.shape[-1])
    return table if table.stride(-1) == 1 else table.contiguous()


def rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Core op `rotary` (see `reference.rotary`); the reference runs for what the kernel does not
    take: other dtypes or devices, q and k of different dtypes, token dims or head dims, tables
    that are not one row per token (`per_token_tables`), tables that require grad."""
    if not _supported(q, k, cos, sin):
        return reference.rotary(q, k, cos, sin, interleaved)
    return Rotation.apply(_launch, q, k, _table_rows(cos), _table_rows(sin), interleaved)
