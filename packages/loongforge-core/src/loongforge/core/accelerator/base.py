"""The accelerator interface and the two built-in backends, `cuda` and `cpu`.

The `cpu` backend is a product feature ("debug any config on a laptop"): it runs megatron-core
on gloo. `CPUAccelerator.setup` adapts the CUDA assumptions megatron-core makes on the paths
LoongForge uses, once per process, before any model is built:
- activation recompute saves and restores RNG state through `_get_cuda_rng_state` /
  `_set_cuda_rng_state`: pointed at the CPU generator;
- dist_checkpointing allocates its small bookkeeping tensors on `torch.cuda.current_device()`
  and calls `torch.cuda.synchronize()`: on a machine without CUDA (where both would raise) the
  first answers the CPU device and the second does nothing. Where CUDA exists they are left
  alone.
Everything else LoongForge calls in megatron-core is device-agnostic as used (CPU weight init,
our own data-parallel sync and pipeline schedule instead of megatron DDP/schedules).
"""

from __future__ import annotations

import os
from contextlib import nullcontext

import torch

from loongforge.core.errors import UserError


class Accelerator:
    name = "base"
    device_type = "cpu"
    backend = "gloo"

    @classmethod
    def is_available(cls) -> bool:
        return False

    def setup(self) -> None:
        """Process-wide preparation, called once before models are built."""

    def device(self) -> torch.device:
        return torch.device(self.device_type)

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def train_dtype(self) -> torch.dtype:
        """Compute dtype of training matmuls (params and optimizer state stay fp32)."""
        return torch.float32

    def autocast(self):
        dt = self.train_dtype()
        if dt == torch.float32:
            return nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=dt)

    def synchronize(self) -> None:
        pass

    def memory_stats(self) -> dict:
        import psutil

        return {"rss_gib": psutil.Process().memory_info().rss / 2**30}

    def reset_peak_memory(self) -> None:
        pass

    def capabilities(self) -> dict:
        return {"bf16": False, "flash_attention": False}

    def peak_flops(self) -> float | None:
        """Dense peak FLOP/s of one device in the training dtype (None: unknown, no MFU)."""
        return None

    def rng_state(self) -> dict:
        return {"cpu": torch.get_rng_state()}

    def set_rng_state(self, state: dict) -> None:
        torch.set_rng_state(state["cpu"])


class CPUAccelerator(Accelerator):
    name = "cpu"
    device_type = "cpu"
    backend = "gloo"

    @classmethod
    def is_available(cls) -> bool:
        return True

    def setup(self) -> None:
        from megatron.core.tensor_parallel import random as mrandom

        def get_state(device="cuda", clone=False, graph_safe=False):
            return torch.get_rng_state()

        def set_state(new_state, device=-1, graph_safe=False):
            torch.set_rng_state(new_state)

        mrandom._get_cuda_rng_state = get_state
        mrandom._set_cuda_rng_state = set_state

        if not torch.cuda.is_available():
            torch.cuda.current_device = lambda: torch.device("cpu")
            torch.cuda.synchronize = lambda device=None: None


class CUDAAccelerator(Accelerator):
    name = "cuda"
    device_type = "cuda"
    backend = "nccl"

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available()

    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def manual_seed(self, seed: int) -> None:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)

    def train_dtype(self) -> torch.dtype:
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def memory_stats(self) -> dict:
        return {
            "mem_alloc_gib": torch.cuda.memory_allocated() / 2**30,
            "mem_peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        }

    def reset_peak_memory(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def capabilities(self) -> dict:
        return {"bf16": torch.cuda.is_bf16_supported(), "flash_attention": True, "name": torch.cuda.get_device_name()}

    # Dense bf16 tensor-core peaks from the vendor data sheets (SXM parts).
    PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12}

    def peak_flops(self) -> float | None:
        name = torch.cuda.get_device_name()
        return next((v for k, v in self.PEAK_BF16.items() if k in name), None)

    def rng_state(self) -> dict:
        return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state()}

    def set_rng_state(self, state: dict) -> None:
        torch.set_rng_state(state["cpu"])
        if "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"])


_ACTIVE: Accelerator | None = None


def get_accelerator(name: str | None = None) -> Accelerator:
    """The process's accelerator: `name`, else `LOONGFORGE_DEVICE`, else the first available of
    the registered ones (cuda before cpu; plugins such as xpu before both)."""
    global _ACTIVE
    from loongforge.core.registry import registry

    want = name or os.environ.get("LOONGFORGE_DEVICE", "auto")
    if _ACTIVE is not None and want in ("auto", _ACTIVE.name):
        return _ACTIVE
    if _ACTIVE is not None:
        raise UserError(f"this process already runs on {_ACTIVE.name!r}; cannot switch to {want!r}")
    reg = registry()
    if want == "auto":
        order = [n for n in reg.names("accelerator") if n not in ("cuda", "cpu")] + ["cuda", "cpu"]
        want = next(n for n in order if reg.get("accelerator", n).is_available())
    cls = reg.get("accelerator", want)
    if not cls.is_available():
        raise UserError(f"LOONGFORGE_DEVICE={want}: that device is not available on this machine")
    acc = cls()
    acc.setup()
    _ACTIVE = acc
    return acc
