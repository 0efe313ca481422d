"""Model + optimizer shards through megatron-core dist_checkpointing (reshards on load).

`select(name) -> bool` limits the model tensors written or read to the named ones (LoRA saves
only its adapters; a LoRA model loads its base weights from a checkpoint without them)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch

Select = Optional[Callable[[str], bool]]


def _model_sharded(model, select: Select) -> dict:
    sd = model.sharded_state_dict()
    return sd if select is None else {k: v for k, v in sd.items() if select(k)}


def _optimizer_sharded(model, optimizer, select: Select):
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    model_sd = _model_sharded(model, select)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    id_map = get_param_id_to_sharded_param_map(model_sd, iter(params))
    osd = optimizer.state_dict()
    optim_state_to_sharding_state(osd, id_map, exclude_keys=("step",))
    return model_sd, osd


def init_optimizer_state(optimizer) -> None:
    """Give every parameter its Adam state tensors, so a load has tensors to fill."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state[p]
            if not st:
                st["step"] = torch.tensor(0.0)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def save_megatron(directory: Path, model, optimizer=None, select: Select = None) -> None:
    from megatron.core import dist_checkpointing

    if optimizer is not None:
        model_sd, osd = _optimizer_sharded(model, optimizer, select)
        sd = {"model": model_sd, "optimizer": osd}
    else:
        sd = {"model": _model_sharded(model, select)}
    dist_checkpointing.save(sd, str(directory))


def load_megatron(directory: Path, model, optimizer=None, optimizer_steps: int = 0, select: Select = None) -> None:
    from megatron.core import dist_checkpointing

    if optimizer is not None:
        init_optimizer_state(optimizer)
        model_sd, osd = _optimizer_sharded(model, optimizer, select)
        sd = {"model": model_sd, "optimizer": osd}
    else:
        sd = {"model": _model_sharded(model, select)}
    loaded = dist_checkpointing.load(sd, Path(directory))
    model.load_state_dict(loaded["model"], strict=False)
    if optimizer is not None:
        osd = loaded["optimizer"]
        for st in osd["state"].values():
            st["step"] = torch.tensor(float(optimizer_steps))
        optimizer.load_state_dict(osd)
