"""What loongforge-core itself registers, through its `loongforge.plugins` entry point (`core`) like
every other package: the decoder families, the two built-in accelerators, and the MoE expert MLP
on torch's grouped GEMM for CUDA devices (on a CPU the op table keeps its reference loop; the
CPU tests call the grouped form directly)."""

from loongforge.core.accelerator import CPUAccelerator, CUDAAccelerator
from loongforge.core.foundation.families import FAMILIES
from loongforge.core.ops import OpImpl, grouped


def register(reg) -> None:
    for fam in FAMILIES:
        reg.add("family", fam.name, fam)
    reg.add("accelerator", "cpu", CPUAccelerator)
    reg.add("accelerator", "cuda", CUDAAccelerator)
    reg.add("op", "moe_expert_mlp.grouped_mm", OpImpl(grouped.moe_expert_mlp, ("cuda",), priority=10))
