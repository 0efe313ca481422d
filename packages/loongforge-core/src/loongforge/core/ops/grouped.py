"""Ops on torch's grouped GEMM (`torch.nn.functional.grouped_mm`): one GEMM launch for all the
experts of a MoE layer instead of one per expert. Registered for CUDA devices (core's plugin);
on CPUs the table keeps the reference, and the CPU tests call this form directly."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from loongforge.core.ops import reference


def _grouped_ok(*tensors: torch.Tensor) -> bool:
    """grouped_mm's conditions: one dtype (bf16 or fp32 on the CPU; bf16 on CUDA), rows whose byte
    strides are multiples of 16."""
    dtype = tensors[0].dtype
    allowed = (torch.bfloat16,) if tensors[0].is_cuda else (torch.bfloat16, torch.float32)
    if dtype not in allowed or any(t.dtype != dtype for t in tensors):
        return False
    return all(t.shape[-1] * t.element_size() % 16 == 0 and t.shape[-2] * t.element_size() % 16 == 0 for t in tensors[1:])


def moe_expert_mlp(
    permuted: torch.Tensor, tokens_per_expert: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, swiglu: Callable = reference.swiglu
) -> torch.Tensor:
    """`reference.moe_expert_mlp` as two grouped GEMMs, without reading the counts on the host
    (the reference itself where grouped_mm does not take the inputs)."""
    if not _grouped_ok(permuted, fc1, fc2):
        return reference.moe_expert_mlp(permuted, tokens_per_expert, fc1, fc2, swiglu)
    offs = tokens_per_expert.cumsum(0).to(torch.int32)
    hidden = F.grouped_mm(permuted.contiguous(), fc1.transpose(1, 2), offs=offs)
    return F.grouped_mm(swiglu(hidden), fc2.transpose(1, 2), offs=offs)
