"""Where the time of one training step goes: torch.profiler over the `loongforge trainer` step of
tools/benchmarks/llm_throughput.py (1.3B config by default), GPU kernels grouped by kind, then the
top kernels.

    python tools/benchmarks/profile_step.py                 # the trainer's GPU default
    python tools/benchmarks/profile_step.py --precision pure
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from llm_throughput import add_model_args, loongforge_step, model_config  # noqa: E402

KINDS = (  # first match wins
    ("matmul (cuBLAS/CUTLASS)", ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas")),
    ("attention (flash/SDPA)", ("flash", "fmha", "attention", "attn")),
    ("optimizer (AdamW, grad norm, copies)", ("adam", "multi_tensor", "foreach", "norm_kernel", "lpnorm")),
)
# Triton kernels appear under their function names
TRITON = {"_rms_norm_fwd", "_rms_norm_bwd", "_swiglu_fwd", "_swiglu_bwd", "_rope", "_qkv_rope", "_ce_rows", "_gather", "_combine"}


def kind_of(name: str) -> str:
    if name in TRITON:
        return "loongforge Triton kernels"
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other (elementwise, casts, reductions, copies)"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--precision", default="masters", choices=["masters", "pure", "fp32"])
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()
    logging.getLogger("megatron").setLevel(logging.ERROR)
    mcfg = model_config(a, a.seq)
    tokens = torch.randint(0, a.vocab, (a.micro_batch, a.seq), device="cuda")
    step, keep = loongforge_step(mcfg, tokens, a.precision, kernels=True)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            step()
        torch.cuda.synchronize()
    # GPU kernels only: the optimizer's user annotation ("Optimizer.step#AdamW.step") also lands
    # on the GPU timeline and would count its kernels twice
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and "#" not in e.key]
    per_kind = defaultdict(float)
    for e in events:
        per_kind[kind_of(e.key)] += e.self_device_time_total / 1e3 / a.steps  # ms per step
    total = sum(per_kind.values())
    print(f"GPU {torch.cuda.get_device_name()}, precision {a.precision}: {total:.1f} ms of GPU kernels per step\n")
    print("| kind | ms/step | share |\n| --- | --- | --- |")
    for kind, ms in sorted(per_kind.items(), key=lambda kv: -kv[1]):
        print(f"| {kind} | {ms:.1f} | {100 * ms / total:.0f}% |")
    print("\n| kernel | kind | ms/step | calls/step |\n| --- | --- | --- | --- |")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:25]:
        print(f"| {e.key[:90]} | {kind_of(e.key)} | {e.self_device_time_total / 1e3 / a.steps:.2f} | {e.count // a.steps} |")
    idle_gaps(prof, a.steps)


def idle_gaps(prof, steps: int, top: int = 12) -> None:
    """GPU idle time between consecutive kernels, and the largest gaps with the kernels around
    them (a gap is the GPU waiting for the CPU to launch, or for a host sync)."""
    kernels = sorted(
        ((e.time_range.start, e.time_range.end, e.name) for e in prof.events() if e.device_type.name == "CUDA" and "#" not in e.name),
        key=lambda k: k[0],
    )
    gaps, end, prev = [], None, ""
    for start, stop, name in kernels:
        if end is not None and start > end:
            gaps.append((start - end, prev, name))
        if end is None or stop > end:
            end, prev = stop, name
    idle = sum(g for g, _, _ in gaps) / 1e3
    span = (kernels[-1][1] - kernels[0][0]) / 1e3 if kernels else 0.0
    print(
        f"\nGPU idle between kernels: {idle / steps:.1f} ms/step of {span / steps:.1f} ms/step spanned; "
        f"{sum(1 for g in gaps if g[0] > 20) // steps} gaps over 20 us per step"
    )
    print("\n| gap us | after | before |\n| --- | --- | --- |")
    for g, a, b in sorted(gaps, reverse=True)[:top]:
        print(f"| {g:.0f} | {a[:60]} | {b[:60]} |")


if __name__ == "__main__":
    main()
