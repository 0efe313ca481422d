"""Launch helpers shared by the kernels."""

from __future__ import annotations

import functools

import torch

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def programs_for(device: torch.device, rows: int, per_sm: int = 8) -> int:
    """A persistent grid: a few programs per SM (4 on the CPU interpreter), at most one per row."""
    sms = num_sms(device.index or 0) if device.type == "cuda" else 1
    return max(1, min(rows, sms * per_sm if device.type == "cuda" else 4))
