"""Model + optimizer shards through megatron-core dist_checkpointing (reshards on load).

`select(name) -> bool` limits the model tensors written or read to the named ones (LoRA saves
only its adapters; a LoRA model loads its base weights from a checkpoint without them)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import signal
import sys
import threading
from pathlib import Path
from typing import Callable, Optional

import torch

Select = Optional[Callable[[str], bool]]

_PR_SET_PDEATHSIG = 1
_saving = threading.local()  # `parent`: this process's pid while this thread writes a checkpoint


def _writer_dies_with_its_parent() -> None:
    """At-fork hook, child side. megatron's torch_dist writer forks one process per write bucket;
    each puts its results on a pipe-backed queue that the trainer reads only after all of them
    finished, and joins that queue's feeder thread as it exits. When the trainer is killed in that
    window and the results exceed the pipe's buffer, the writers block forever on the pipe (their
    siblings hold its read end) and stay behind as orphans. A process forked while this thread
    saves gets SIGKILL when its parent thread ends, which for the writers is only ever the
    trainer's death (the saving thread waits for them); forks at other times are untouched."""
    parent = getattr(_saving, "parent", None)
    if parent is None or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent was gone before the signal was armed
        os._exit(1)
    _saving.parent = os.getpid()  # (a writer's own forks die with it in turn)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_writer_dies_with_its_parent)


@contextlib.contextmanager
def writers_die_with_this_process():
    """While inside, processes this thread forks die with it (see `_writer_dies_with_its_parent`)."""
    _saving.parent = os.getpid()
    try:
        yield
    finally:
        _saving.parent = None


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
    from loongforge.core.train.optimizer import init_adamw_state

    for group in optimizer.param_groups:
        for p in group["params"]:
            if not optimizer.state[p]:
                init_adamw_state(optimizer.state[p], p, getattr(optimizer, "ema_decay", 0.0), step=torch.tensor(0.0))


def _ensure_write_results_queue() -> None:
    """Give megatron's checkpoint writer its results queue: a queue of this process.

    Saves here are synchronous (`dist_checkpointing.save`): megatron runs its write function in
    the calling process (its forked per-bucket writers report on a pipe of their own) and reads
    the results back in the same process, so a thread queue carries them. Left to itself,
    megatron makes one module-global queue on a spawn-context `multiprocessing` Manager: a server
    process per trainer, a fresh interpreter importing torch (seconds of CPU at every first save)
    that ran for the life of the trainer, with a resource tracker beside it. megatron makes the
    queue only while the global is unset, so setting it once is enough."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def save_megatron(directory: Path, model, optimizer=None, select: Select = None) -> None:
    from megatron.core import dist_checkpointing

    if optimizer is not None:
        model_sd, osd = _optimizer_sharded(model, optimizer, select)
        sd = {"model": model_sd, "optimizer": osd}
    else:
        sd = {"model": _model_sharded(model, select)}
    _ensure_write_results_queue()
    with writers_die_with_this_process():
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


@torch.no_grad()
def load_full_state(model, state: dict, skip: Select = None) -> None:
    """Copy a whole TP=1, PP=1 LoongForge state dict (e.g. mapped from HF) into this rank's
    shards of a megatron model at any TP/PP layout, in process: every tensor of the model's
    `sharded_state_dict` (factories such as the SwiGLU fc1 split built into their parts, which
    are views of the parameters) takes its slice of the full tensor by its global offset.
    `skip(name)` leaves model tensors out (LoRA adapters the state lacks)."""
    from loongforge.core.errors import UserError
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    def tensors(x):
        for v in nested_values(x):
            if isinstance(v, ShardedTensorFactory):
                yield from tensors(v.build())
            elif isinstance(v, ShardedTensor):
                yield v

    # per-layer keys with global layer numbers (as a TP=1, PP=1 state dict names them), not
    # megatron's default of layers stacked along a leading axis
    for sh in tensors(model.sharded_state_dict(metadata={"non_homogeneous_layers": True})):
        if skip is not None and skip(sh.key):
            continue
        if sh.key not in state:
            raise UserError(f"weights do not fit the model: missing {sh.key!r}")
        full = state[sh.key]
        pre = sh.prepend_axis_num  # axes the checkpoint stacks tensors along (none in a TP=1 state dict)
        if tuple(full.shape) != tuple(sh.global_shape[pre:]) or any(n != 1 for n in sh.global_shape[:pre]):
            raise UserError(f"weight {sh.key}: shape {tuple(full.shape)} does not fit the model's {tuple(sh.global_shape[pre:])}")
        sh.data.copy_(full[tuple(slice(o, o + n) for o, n in zip(sh.global_offset[pre:], sh.local_shape))])
