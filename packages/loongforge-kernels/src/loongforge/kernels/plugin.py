"""What loongforge-kernels registers: a Triton implementation of each op it has, for CUDA
devices (on a CPU core keeps its references; tests run the kernels there under
TRITON_INTERPRET=1 by calling them directly)."""


def register(reg) -> None:
    from loongforge.core.ops import OpImpl
    from loongforge.kernels import (
        adamw,
        linear_cross_entropy,
        moe_permute,
        qkv_rope,
        rms_norm,
        rope,
        rotary,
        sum_squares,
        swiglu,
        varlen_attention,
    )

    cuda = ("cuda",)
    for op, fn in (
        ("rms_norm", rms_norm.rms_norm),
        ("add_rms_norm", rms_norm.add_rms_norm),
        ("gemma_rms_norm", rms_norm.gemma_rms_norm),
        ("rope", rope.rope),
        ("qkv_rope", qkv_rope.qkv_rope),
        ("rotary", rotary.rotary),
        ("swiglu", swiglu.swiglu),
        ("geglu", swiglu.geglu),
        ("linear_cross_entropy", linear_cross_entropy.linear_cross_entropy),
        ("moe_permute", moe_permute.moe_permute),
        ("moe_unpermute", moe_permute.moe_unpermute),
        ("adamw", adamw.adamw),
        ("sum_squares", sum_squares.sum_squares),
    ):
        reg.add("op", f"{op}.triton", OpImpl(fn, cuda, priority=10))
    reg.add("op", "varlen_attention.flash", OpImpl(varlen_attention.varlen_attention, cuda, priority=10))
    reg.add("op", "packed_attention.flash", OpImpl(varlen_attention.packed_attention, cuda, priority=10))
