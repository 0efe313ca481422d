"""Hardware backends behind one interface; `LOONGFORGE_DEVICE` picks one (default: auto)."""

from loongforge.core.accelerator.base import (
    Accelerator,
    CPUAccelerator,
    CUDAAccelerator,
    active_accelerator,
    get_accelerator,
    release_accelerator,
    to_device,
)

__all__ = ["Accelerator", "CPUAccelerator", "CUDAAccelerator", "active_accelerator", "get_accelerator", "release_accelerator", "to_device"]
