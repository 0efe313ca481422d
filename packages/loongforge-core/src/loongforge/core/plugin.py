"""What loongforge-core itself registers."""

from loongforge.core.accelerator import CPUAccelerator, CUDAAccelerator
from loongforge.core.foundation.families import FAMILIES


def register(reg) -> None:
    for fam in FAMILIES:
        reg.add("family", fam.name, fam)
    reg.add("accelerator", "cpu", CPUAccelerator)
    reg.add("accelerator", "cuda", CUDAAccelerator)
