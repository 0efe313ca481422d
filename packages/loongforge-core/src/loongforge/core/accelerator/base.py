"""The accelerator interface and the two built-in backends, `cuda` and `cpu`.

The `cpu` backend is a product feature ("debug any config on a laptop"): it runs megatron-core
on gloo. Nothing is changed at import. `CPUAccelerator.prepare_megatron()` (run by
`init_parallel` before it lays out megatron's parallel state, so only by processes that use
megatron-core: the torch stack never imports it) adapts the CUDA assumptions of the megatron-core
code LoongForge runs on the CPU, each by replacing one attribute of one megatron module, and
`teardown()` (run by `release_accelerator()`) puts every one back. torch itself is never
patched: `torch.cuda.current_device()` and `torch.cuda.synchronize()` stay torch's.
- `megatron.core.tensor_parallel.random._get_cuda_rng_state` / `_set_cuda_rng_state`
  (activation recompute saves and restores the RNG state through them): the CPU generator's.
- `MoEAlltoAllTokenDispatcher.cuda_dtoh_stream` (the side stream its constructor creates on
  CUDA unless one exists): a CPU stream, which LoongForge's all-to-all dispatcher never uses off
  CUDA (it reads the token counts where they are needed).
- `torch` as seen by the modules in `CPU_TORCH_VIEW_MODULES`: a view of torch whose
  `cuda.current_device()` is the CPU device and whose `cuda.synchronize()` does nothing;
  every other attribute is torch's own. Saving a checkpoint allocates the failure flag it
  broadcasts after writing on `torch.cuda.current_device()` and synchronizes after copying
  the tensors to write (`dist_checkpointing.strategies`); a MoE router moves its weight to
  `torch.cuda.current_device()` on its first forward (`transformer.moe.router`); expert-parallel
  token dispatch allocates its gather buffers there (`tensor_parallel.mappings`, and
  `megatron.core.utils`' global buffer), and so does a parallel linear's backward under sequence
  parallelism (`tensor_parallel.layers`). These are the calls into `torch.cuda` that
  LoongForge's CPU runs make (pretraining, SFT and LoRA, TP=2 and PP=2 on gloo, MoE with EP=2,
  sequence parallelism, save, resume with resharding, HF import/export), found by recording
  every caller in those runs. The view is used whether or not the machine has CUDA: under the cpu accelerator
  megatron's tensors live on the CPU.
Everything else LoongForge calls in megatron-core is device-agnostic as used (CPU weight init,
our own data-parallel sync and pipeline schedule instead of megatron DDP/schedules).
"""

from __future__ import annotations

import importlib
import os
import sys
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

    def teardown(self) -> None:
        """Undo `setup` and `prepare_megatron`."""

    def prepare_megatron(self) -> None:
        """Adapt megatron-core to this device, once; `init_parallel` calls it before laying out
        megatron's parallel state."""

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

    def peak_flops(self) -> float | None:
        """Dense peak FLOP/s of one device in the training dtype (None: unknown, no MFU)."""
        return None

    def rng_state(self) -> dict:
        return {"cpu": torch.get_rng_state()}

    def set_rng_state(self, state: dict) -> None:
        torch.set_rng_state(state["cpu"])


def _megatron_parallel_initialized() -> bool:
    """Whether megatron's parallel state exists in this process (not where megatron-core was
    never imported, as on the torch stack: importing it takes seconds)."""
    ps = sys.modules.get("megatron.core.parallel_state")
    return ps is not None and ps.model_parallel_is_initialized()


class _CPUCuda:
    """`torch.cuda` for megatron code running on the CPU: the current device is the CPU and
    there is nothing to synchronize; every other attribute is torch.cuda's."""

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def synchronize(device=None) -> None:
        return None

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _CPUTorch:
    """`torch` with `cuda` replaced by `_CPUCuda`, for the modules in CPU_TORCH_VIEW_MODULES."""

    cuda = _CPUCuda()

    def __getattr__(self, name):
        return getattr(torch, name)


CPU_TORCH_VIEW_MODULES = (
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.transformer.moe.router",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.utils",
)


def _cpu_rng_state(device="cuda", clone=False, graph_safe=False):
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


class CPUAccelerator(Accelerator):
    name = "cpu"
    device_type = "cpu"
    backend = "gloo"

    def __init__(self) -> None:
        self._replaced: list[tuple[object, str, object]] = []  # (module, attribute, original value)

    @classmethod
    def is_available(cls) -> bool:
        return True

    def prepare_megatron(self) -> None:
        if self._replaced:
            return
        from megatron.core.tensor_parallel import random as mrandom
        from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

        swaps = [(mrandom, "_get_cuda_rng_state", _cpu_rng_state), (mrandom, "_set_cuda_rng_state", _set_cpu_rng_state)]
        swaps.append((MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", torch.Stream("cpu")))
        swaps += [(importlib.import_module(m), "torch", _CPUTorch()) for m in CPU_TORCH_VIEW_MODULES]
        for module, attr, value in swaps:
            self._replaced.append((module, attr, getattr(module, attr)))
            setattr(module, attr, value)

    def manual_seed(self, seed: int) -> None:
        """torch's generator, and where megatron's parallel state exists its RNG tracker's states
        (forked by sequence-parallel embedding dropout, even at rate 0) as CPU generator states,
        seeded as megatron's `model_parallel_cuda_manual_seed` seeds its CUDA ones."""
        torch.manual_seed(seed)
        if not _megatron_parallel_initialized():
            return
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import random as mrandom

        seeds = {
            mrandom._DATA_PARALLEL_RNG_TRACKER_NAME: seed,
            mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME: seed + 2718 + ps.get_tensor_model_parallel_rank(),
            mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME: seed
            + 1024
            + 100 * ps.get_expert_model_parallel_rank()
            + ps.get_expert_tensor_parallel_rank(),
        }
        tracker = mrandom.get_cuda_rng_tracker()
        tracker.reset()
        tracker.set_states({name: torch.Generator().manual_seed(s).get_state() for name, s in seeds.items()})

    def teardown(self) -> None:
        while self._replaced:
            module, attr, original = self._replaced.pop()
            setattr(module, attr, original)


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
        """torch's generators, and megatron's tensor-parallel RNG tracker where megatron's
        parallel state exists (the megatron stack; the torch stack never initializes it)."""
        torch.manual_seed(seed)
        if _megatron_parallel_initialized():
            from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

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


def to_device(value, device):
    """A host tensor onto `device` without a host sync: CUDA copies go from pinned memory,
    non-blocking (a plain copy from pageable memory waits for the device's queue). Values that
    are not tensors pass through."""
    if not torch.is_tensor(value):
        return value
    device = torch.device(device)
    if device.type == "cuda" and value.device.type == "cpu":
        return value.pin_memory().to(device, non_blocking=True)
    return value.to(device)


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


def active_accelerator() -> Accelerator | None:
    """The accelerator `get_accelerator()` set up in this process, if any."""
    return _ACTIVE


def release_accelerator() -> None:
    """Tear down the process's accelerator (undoing its `setup`) and forget it, so that the
    process is as before the first `get_accelerator()`; the CLIs call this on exit."""
    global _ACTIVE
    if _ACTIVE is not None:
        _ACTIVE.teardown()
        _ACTIVE = None
