"""Kernel benchmarks on one GPU, baselines in the same process: LoongForge's Triton kernels
against torch.compile of core's reference, torch's own op (F.rms_norm) and Liger-Kernel's
kernel where one exists. Forward + backward, bf16.

    python tools/benchmarks/kernels.py                # every kernel at every benchmark shape
    python tools/benchmarks/kernels.py --only rms_norm --quick

Memory-bound kernels report achieved GB/s (bytes: each input read once and each output written
once, forward + backward) against a device-to-device copy measured here; times are medians of
CUDA-event timings (triton.testing.do_bench) with fresh inputs per shape. The fused linear
cross-entropy reports time and extra peak memory (peak minus what the inputs hold).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton

from loongforge.core.ops import reference as ref


def bench(fn, warmup=25, rep=100) -> float:
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def copy_bandwidth() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))
    return 2 * x.numel() / ms / 1e6  # GB/s, read + write


def fwd_bwd(fn, inputs, grad):
    def step():
        for t in inputs:
            t.grad = None
        out = fn(*inputs)
        out.backward(grad)
    return step


def maybe(make):
    try:
        return make()
    except Exception as e:  # a baseline missing on this machine is reported, not fatal
        print(f"  (baseline unavailable: {type(e).__name__}: {str(e).splitlines()[0][:120]})", flush=True)
        return None


def rms_norm_rows(shapes, copy_gbs):
    from loongforge.kernels.rms_norm import rms_norm

    rows = []
    for tokens, hidden in shapes:
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.nn.Parameter(torch.randn(hidden, device="cuda", dtype=torch.bfloat16))
        g = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        setups = {
            "loongforge": lambda a, b: rms_norm(a, b, 1e-6),
            "torch.compile(reference)": torch.compile(lambda a, b: ref.rms_norm(a, b, 1e-6), dynamic=False),
            "F.rms_norm": lambda a, b: F.rms_norm(a, (hidden,), b, 1e-6),
        }
        liger = maybe(lambda: __import__("liger_kernel.transformers", fromlist=["LigerRMSNorm"]).LigerRMSNorm(hidden, eps=1e-6).cuda().bfloat16())
        if liger is not None:
            liger.weight = w
            setups["liger"] = lambda a, b: liger(a)
        nbytes = 5 * tokens * hidden * 2
        for name, fn in setups.items():
            ms = bench(fwd_bwd(fn, [x, w], g))
            rows.append({"kernel": "rms_norm fwd+bwd", "shape": f"{tokens}x{hidden}", "setup": name, "ms": ms,
                         "GB/s": nbytes / ms / 1e6, "of copy": nbytes / ms / 1e6 / copy_gbs})
    return rows


def swiglu_rows(shapes, copy_gbs):
    from loongforge.kernels.swiglu import swiglu

    rows = []
    for tokens, ffn in shapes:
        x = torch.randn(tokens, 2 * ffn, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(tokens, ffn, device="cuda", dtype=torch.bfloat16)
        setups = {"loongforge": swiglu, "torch.compile(reference)": torch.compile(ref.swiglu, dynamic=False), "eager reference": ref.swiglu}
        lig = maybe(lambda: __import__("liger_kernel.ops.swiglu", fromlist=["LigerSiLUMulFunction"]).LigerSiLUMulFunction)
        if lig is not None:
            setups["liger"] = lambda a: lig.apply(a[:, :ffn], a[:, ffn:])
        nbytes = (2 + 1 + 2 + 1 + 2) * tokens * ffn * 2  # fwd: read gate+up, write out; bwd: read gate+up+dout, write 2
        for name, fn in setups.items():
            ms = bench(fwd_bwd(fn, [x], g))
            rows.append({"kernel": "swiglu fwd+bwd", "shape": f"{tokens}x{ffn}", "setup": name, "ms": ms,
                         "GB/s": nbytes / ms / 1e6, "of copy": nbytes / ms / 1e6 / copy_gbs})
    return rows


def rope_rows(shapes, copy_gbs):
    from loongforge.kernels.rope import rope

    rows = []
    for b, s, h, d in shapes:
        x = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
        inv = ref.rope_inv_freq(d, 500000.0).cuda()
        pos = torch.arange(s, device="cuda")
        setups = {"loongforge": lambda a: rope(a, pos, inv), "torch.compile(reference)": torch.compile(lambda a: ref.rope(a, pos, inv), dynamic=False),
                  "eager reference": lambda a: ref.rope(a, pos, inv)}
        nbytes = 4 * x.numel() * 2
        for name, fn in setups.items():
            ms = bench(fwd_bwd(fn, [x], g))
            rows.append({"kernel": "rope fwd+bwd", "shape": f"{b}x{s}x{h}x{d}", "setup": name, "ms": ms,
                         "GB/s": nbytes / ms / 1e6, "of copy": nbytes / ms / 1e6 / copy_gbs})
    return rows


def linear_ce_rows(n=16384, h=4096, v=128256):
    from loongforge.kernels.linear_cross_entropy import linear_cross_entropy

    rows = []
    hid = (torch.randn(n, h, device="cuda", dtype=torch.bfloat16) / 4).requires_grad_(True)
    w = (torch.randn(v, h, device="cuda", dtype=torch.bfloat16) / h**0.5).requires_grad_(True)
    labels = torch.randint(0, v, (n,), device="cuda")
    tw = torch.full((n,), 1.0 / n, device="cuda")

    def unfused(fp32):
        def f():
            logits = hid @ w.T
            loss = F.cross_entropy(logits.float() if fp32 else logits, labels)
            loss.backward()
        return f

    setups = {"loongforge fused": lambda: linear_cross_entropy(hid, w, labels, tw).backward(),
              "unfused, fp32 logits": unfused(True), "unfused, bf16 logits": unfused(False)}
    liger = maybe(lambda: __import__("liger_kernel.transformers", fromlist=["LigerFusedLinearCrossEntropyLoss"]).LigerFusedLinearCrossEntropyLoss())
    if liger is not None:
        setups["liger fused"] = lambda: liger(w, hid, labels).backward()
    for name, step in setups.items():
        def run():
            hid.grad = None
            w.grad = None
            step()
        run()
        torch.cuda.synchronize()
        hid.grad = None
        w.grad = None
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        extra = (torch.cuda.max_memory_allocated() - base) / 2**30
        ms = bench(run, warmup=3, rep=20)
        rows.append({"kernel": "linear+CE fwd+bwd", "shape": f"{n}x{h}x{v}", "setup": name, "ms": ms, "extra GiB": extra})
    hid.grad = None
    w.grad = None
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="rms_norm,swiglu,rope,linear_ce")
    p.add_argument("--quick", action="store_true", help="one small shape per kernel")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth()
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; copy {copy_gbs:.0f} GB/s", flush=True)
    shapes = [(t, h) for h in (2048, 4096, 8192) for t in (8192, 32768)] if not a.quick else [(8192, 2048)]
    rows = []
    only = a.only.split(",")
    if "rms_norm" in only:
        rows += rms_norm_rows(shapes, copy_gbs)
    if "swiglu" in only:
        rows += swiglu_rows([(t, f) for t in (8192, 32768) for f in (5632, 14336)] if not a.quick else [(8192, 5632)], copy_gbs)
    if "rope" in only:
        rows += rope_rows([(4, 2048, 16, 128), (1, 8192, 32, 128)] if not a.quick else [(4, 2048, 16, 128)], copy_gbs)
    if "linear_ce" in only:
        rows += linear_ce_rows() if not a.quick else linear_ce_rows(2048, 1024, 32000)
    print("\n| kernel | shape | setup | ms | GB/s | of copy | extra GiB |\n| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        gbs = f"{r['GB/s']:.0f}" if "GB/s" in r else ""
        frac = f"{100 * r['of copy']:.0f}%" if "of copy" in r else ""
        mem = f"{r['extra GiB']:.2f}" if "extra GiB" in r else ""
        print(f"| {r['kernel']} | {r['shape']} | {r['setup']} | {r['ms']:.3f} | {gbs} | {frac} | {mem} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "copy_GBs": copy_gbs, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
