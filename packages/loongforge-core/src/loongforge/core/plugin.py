"""What loongforge-core itself registers, through its `loongforge.plugins` entry point (`core`) like
every other package: the decoder families and the two built-in accelerators."""

from loongforge.core.accelerator import CPUAccelerator, CUDAAccelerator
from loongforge.core.foundation.families import FAMILIES


def register(reg) -> None:
    for fam in FAMILIES:
        reg.add("family", fam.name, fam)
    reg.add("accelerator", "cpu", CPUAccelerator)
    reg.add("accelerator", "cuda", CUDAAccelerator)
