"""`ParallelContext`: the process groups and ranks one model component trains with.

megatron-core's `parallel_state` is initialized once per process (its dist-checkpointing needs
it); every module then receives its groups explicitly through `pg_collection` and the context,
and nothing swaps the globals afterwards.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from functools import cached_property
from typing import Callable

import torch
import torch.distributed as dist

from loongforge.core.errors import UserError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ParallelContext:
    tp_size: int
    pp_size: int
    dp_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: object
    pp_group: object
    dp_group: object
    mp_group: object
    embedding_group: object

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def prev_rank(self) -> int:
        return dist.get_global_rank(self.pp_group, self.pp_rank - 1)

    @property
    def next_rank(self) -> int:
        return dist.get_global_rank(self.pp_group, self.pp_rank + 1)

    @cached_property
    def _pgs(self):
        from megatron.core.process_groups_config import ProcessGroupCollection

        return ProcessGroupCollection.use_mpu_process_groups()

    def pg_collection(self):
        return self._pgs

    def layout(self) -> dict:
        return {"tensor_model_parallel_size": self.tp_size, "pipeline_model_parallel_size": self.pp_size, "data_parallel_size": self.dp_size}


def init_parallel(tp: int, pp: int, backend: str, device_type: str) -> ParallelContext:
    """Join (or create, for a single process) the default process group and lay out TP x PP x DP.

    Multi-process runs are started by torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
    """
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            if device_type == "cuda":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group(backend=backend)
        else:
            dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    world = dist.get_world_size()
    if world % (tp * pp):
        raise UserError(
            f"world size {world} is not divisible by tensor_model_parallel_size*pipeline_model_parallel_size={tp * pp}"
        )
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())
        if have != (tp, pp):
            raise UserError(f"this process already runs TP={have[0]} PP={have[1]}; cannot build a TP={tp} PP={pp} model in it")
    else:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    return ParallelContext(
        tp_size=tp,
        pp_size=pp,
        dp_size=world // (tp * pp),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        dp_group=ps.get_data_parallel_group(),
        mp_group=ps.get_model_parallel_group(),
        embedding_group=ps.get_embedding_group() if pp > 1 else None,
    )


def on_rank0(fn: Callable[[], None]) -> None:
    """Run `fn` on global rank 0 only; every rank then raises rank 0's UserError, if it raised
    one, so no rank is left waiting in a collective for a rank that failed."""
    error = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            fn()
        except UserError as e:
            error[0] = str(e)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise UserError(error[0])
