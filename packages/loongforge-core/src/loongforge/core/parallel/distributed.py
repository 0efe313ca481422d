"""Joining the default process group (torchrun's environment, or a single local process)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def init_process_group(backend: str, device_type: str) -> None:
    """Join (or create, for a single process) the default process group. Multi-process runs are
    started by torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
    from loongforge.core.parallel.context import free_port

    if dist.is_initialized():
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend=backend)
    else:
        dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
