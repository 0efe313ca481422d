"""Kernel benchmarks on one GPU, baselines in the same process: LoongForge's Triton kernels
against torch.compile of core's reference, torch's own op (F.rms_norm), Liger-Kernel's kernel
(RMSNorm, Gemma's RMSNorm, SwiGLU, GeGLU, RoPE and rotary, fused linear + CE) and megatron-core's MoE permute/unpermute
where one exists. Forward + backward, bf16. The RoPE, rotary and MoE setups are first checked against
the eager reference on the same inputs (outputs and gradients), so a peer called the wrong way
stops the run instead of being timed.

    python tools/benchmarks/kernels.py                # every kernel at every benchmark shape
    python tools/benchmarks/kernels.py --only rms_norm --quick

Every setup is timed twice: `ms` launches from Python each time (triton.testing.do_bench, median
of CUDA-event timings: at small shapes this is the CPU's launch time, which Python autograd
Functions pay more than torch's C++ ops), and `graph ms` replays the same forward + backward from
a CUDA graph (triton.testing.do_bench_cudagraph: GPU time only, what a step that keeps the GPU
busy sees). The memory-bound fwd+bwd rows add `cold graph ms`: the same replay with L2 flushed
(a 256 MiB read) before each step, so a kernel that finds its own last outputs in L2 gains
nothing. Memory-bound kernels report achieved GB/s from the graph time (bytes: each input read
once and each output written once, forward + backward) against a device-to-device copy of 1 GiB
measured here. The fused linear cross-entropy reports time and extra peak memory (peak minus what
the inputs hold).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import torch
import torch.nn.functional as F
import triton
from loongforge.core.ops import reference as ref


def bench(fn, warmup=25, rep=100) -> float:
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def bench_graph(fn) -> float | None:
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    except Exception as e:  # a setup that cannot be captured keeps its eager timing only
        print(f"  (no CUDA graph timing: {type(e).__name__}: {str(e).splitlines()[0][:120]})", flush=True)
        torch.cuda.synchronize()
        return None


@functools.cache
def _l2_flush_buffer() -> torch.Tensor:
    return torch.empty(64 << 20, dtype=torch.float32, device="cuda").normal_()  # 256 MiB


def bench_graph_cold(fn) -> float | None:
    """GPU time of `fn` with a cold L2 cache: `bench_graph` of (read 256 MiB, fn) minus
    `bench_graph` of the read alone. `bench_graph` replays `fn` back to back, so a kernel that
    rewrites its inputs in place finds part of them in L2 (50 MiB on an H100/H200) on the next
    call; in a training step other layers run in between."""
    buf = _l2_flush_buffer()
    both = bench_graph(lambda: (buf.sum(), fn()))
    return None if both is None else both - bench_graph(buf.sum)


def row(kernel, shape, name, step, nbytes, copy_gbs, cold=False) -> dict:
    """Times `step` from Python, from a CUDA graph and (`cold`) from a CUDA graph with L2 flushed
    before each call; GB/s and the share of copy come from the graph time."""
    ms = bench(step)
    gms = bench_graph(step)
    t = gms if gms is not None else ms
    r = {
        "kernel": kernel,
        "shape": shape,
        "setup": name,
        "ms": ms,
        "graph ms": gms,
        "GB/s": nbytes / t / 1e6,
        "of copy": nbytes / t / 1e6 / copy_gbs,
    }
    if cold:
        r["cold graph ms"] = bench_graph_cold(step) if gms is not None else None  # bench_graph said why not
    return r


def copy_bandwidth() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))
    return 2 * x.numel() / ms / 1e6  # GB/s, read + write


def fwd_bwd(fn, inputs, grads):
    """One forward + backward of `fn` (one output, or a tuple of them with a tuple of `grads`)."""

    def step():
        for t in inputs:
            t.grad = None
        torch.autograd.backward(fn(*inputs), grads)

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
        liger = maybe(
            lambda: __import__("liger_kernel.transformers", fromlist=["LigerRMSNorm"]).LigerRMSNorm(hidden, eps=1e-6).cuda().bfloat16()
        )
        if liger is not None:
            liger.weight = w
            setups["liger"] = lambda a, b: liger(a)
        nbytes = 5 * tokens * hidden * 2
        for name, fn in setups.items():
            rows.append(row("rms_norm fwd+bwd", f"{tokens}x{hidden}", name, fwd_bwd(fn, [x, w], g), nbytes, copy_gbs, cold=True))
    return rows


def gemma_rms_norm_rows(shapes, copy_gbs):
    """Gemma's norm with the fp32 weight pi0.5 keeps beside bf16 activations."""
    from loongforge.kernels.rms_norm import gemma_rms_norm

    rows = []
    for tokens, hidden in shapes:
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.nn.Parameter(0.1 * torch.randn(hidden, device="cuda"))
        g = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        setups = {
            "loongforge": lambda a, b: gemma_rms_norm(a, b, 1e-6),
            "torch.compile(reference)": torch.compile(lambda a, b: ref.gemma_rms_norm(a, b, 1e-6), dynamic=False),
            "eager reference": lambda a, b: ref.gemma_rms_norm(a, b, 1e-6),
        }
        liger = maybe(
            lambda: (
                __import__("liger_kernel.transformers", fromlist=["LigerRMSNorm"])
                .LigerRMSNorm(hidden, eps=1e-6, offset=1.0, casting_mode="gemma", init_fn="zeros")
                .cuda()
            )
        )
        if liger is not None:
            liger.weight = w
            setups["liger"] = lambda a, b: liger(a)
        nbytes = 5 * tokens * hidden * 2  # fwd: read x, write y; bwd: read x and dy, write dx
        for name, fn in setups.items():
            rows.append(row("gemma_rms_norm fwd+bwd", f"{tokens}x{hidden}", name, fwd_bwd(fn, [x, w], g), nbytes, copy_gbs, cold=True))
    return rows


LIGER_GATED = {"swiglu": ("liger_kernel.ops.swiglu", "LigerSiLUMulFunction"), "geglu": ("liger_kernel.ops.geglu", "LigerGELUMulFunction")}


def gated_rows(op, shapes, copy_gbs):
    """`swiglu` or `geglu` on [gate | up]."""
    from loongforge.kernels import swiglu as kernels

    rows = []
    for tokens, ffn in shapes:
        x = torch.randn(tokens, 2 * ffn, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(tokens, ffn, device="cuda", dtype=torch.bfloat16)
        reference = getattr(ref, op)
        setups = {
            "loongforge": getattr(kernels, op),
            "torch.compile(reference)": torch.compile(reference, dynamic=False),
            "eager reference": reference,
        }
        module, name = LIGER_GATED[op]
        lig = maybe(lambda: getattr(__import__(module, fromlist=[name]), name))
        if lig is not None:
            setups["liger"] = lambda a: lig.apply(a[:, :ffn], a[:, ffn:])
        nbytes = (2 + 1 + 2 + 1 + 2) * tokens * ffn * 2  # fwd: read gate+up, write out; bwd: read gate+up+dout, write 2
        for name, fn in setups.items():
            rows.append(row(f"{op} fwd+bwd", f"{tokens}x{ffn}", name, fwd_bwd(fn, [x], g), nbytes, copy_gbs, cold=True))
    return rows


def agreement(setups, inputs, grads, tol):
    """Every setup's outputs and input gradients against the first setup's (the eager reference)
    on fresh copies of `inputs` and `grads`, before anything is timed: a peer called the wrong way fails here. Returns
    {name: largest difference / largest reference magnitude} for the setups that ran (a peer that
    fails to run on this machine is reported and left out); raises past `tol`."""
    results, errors = {}, {}
    for name, fn in setups.items():
        leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
        try:
            outs = fn(*leaves)
            outs = outs if isinstance(outs, tuple) else (outs,)
            torch.autograd.backward(outs, [g.clone() for g in grads])
        except Exception as e:
            if not results:
                raise
            print(f"  ({name} did not run: {type(e).__name__}: {str(e).splitlines()[0][:120]})", flush=True)
            continue
        results[name] = [o.detach().float() for o in outs] + [t.grad.float() for t in leaves]
    want = next(iter(results.values()))
    for name, got in results.items():
        errors[name] = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() for a, b in zip(got, want))
        if not errors[name] <= tol:  # NaN fails too
            raise RuntimeError(f"{name} disagrees with the reference: relative difference {errors[name]:.3g} > {tol}")
    return errors


def rope_setups(b, s, hq, hk, d, device):
    """RoPE on a query and a key tensor ([b, s, heads, d], bf16) as a GQA attention layer needs it:
    eager and torch.compile of the reference, our kernel (both tensors in one launch), and Liger's
    LigerRopeFunction (also one launch; HF's [b, heads, s, d] view, the cos/sin tables in bf16 as
    HF's rotary embedding builds them; it rotates its inputs in place). Returns
    ((q, k), (grad q', grad k'), setups: name -> fn(q, k) -> (q', k') in [b, s, heads, d])."""
    from loongforge.kernels.rope import rope

    gen = torch.Generator(device=device).manual_seed(0)
    q0, k0, gq, gk = (torch.randn(b, s, h, d, device=device, generator=gen).to(torch.bfloat16) for h in (hq, hk, hq, hk))
    inv = ref.rope_inv_freq(d, 500000.0).to(device)
    pos = torch.arange(s, device=device)
    setups = {"eager reference": lambda q, k: ref.rope(q, k, pos, inv), "loongforge": lambda q, k: rope(q, k, pos, inv)}
    if device != "cpu":
        setups["torch.compile(reference)"] = torch.compile(lambda q, k: ref.rope(q, k, pos, inv), dynamic=False)
    lig = maybe(lambda: __import__("liger_kernel.ops.rope", fromlist=["LigerRopeFunction"]).LigerRopeFunction)
    if lig is not None:
        emb = torch.cat([pos.float()[:, None] * inv.float()] * 2, dim=-1)
        cos, sin = emb.cos().to(torch.bfloat16)[None], emb.sin().to(torch.bfloat16)[None]

        def liger(q, k):
            qo, ko = lig.apply(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            return qo.transpose(1, 2), ko.transpose(1, 2)

        setups["liger"] = liger
    return (q0, k0), (gq, gk), setups


def rope_rows(shapes, copy_gbs, sweep=((8, 2), (16, 1), (16, 4), (32, 4)), device="cuda"):
    """Forward + backward of every setup, then our forward alone at the default launch parameters
    (`BLOCK_H` q heads per program, `WARPS` warps) and others: the backward is the same kernel."""
    from loongforge.kernels import rope as krope

    rows = []
    for b, s, hq, hk, d in shapes:
        shape = f"{b}x{s}x({hq}+{hk})x{d}"
        inputs, grads, setups = rope_setups(b, s, hq, hk, d, device)
        errors = agreement(setups, inputs, grads, 2e-2)
        print(f"rope q+k {shape}, relative difference to the eager reference:", {n: f"{e:.2g}" for n, e in errors.items()}, flush=True)
        q, k = (t.clone().requires_grad_(True) for t in inputs)
        grads = [g.clone() for g in grads]
        nbytes = 4 * (q.numel() + k.numel()) * 2  # fwd: read, write; bwd: read, write; per tensor
        for name in errors:
            rows.append(row("rope q+k fwd+bwd", shape, name, fwd_bwd(setups[name], [q, k], grads), nbytes, copy_gbs, cold=True))
        pos, inv = torch.arange(s, device=device), ref.rope_inv_freq(d, 500000.0).to(device)
        for block_h, warps in ((krope.BLOCK_H, krope.WARPS),) + tuple(sweep):

            def fwd(block_h=block_h, warps=warps):
                krope._launch(q, k, pos, inv, False, 1.0, block_h, warps)

            rows.append(row("rope q+k fwd", shape, f"loongforge {block_h} heads, {warps} warps", fwd, nbytes // 2, copy_gbs))
    return rows


def rotary_setups(t, hq, hk, d, layout, device):
    """Op `rotary` (angle tables) on a query and a key tensor (bf16, half-split pairs, fp32 tables
    [t, 1, d/2]) laid out as its callers lay them out: `1thd`, [1, t, heads, d] (the LLM's M-RoPE
    path), or `fused`, [t, heads, d] strided views of one [t, hq + 2 hk, d] projection (the vision
    tower's q / k). Setups: eager and torch.compile of the reference, our kernel, and Liger's
    LigerRopeFunction (HF's [b, heads, s, d] view, the tables repeated to the full head_dim; it
    rotates its inputs in place). Returns ((q, k), (grad q', grad k'), setups: name -> fn(q, k) -> (q', k'))."""
    from loongforge.kernels.rotary import rotary

    gen = torch.Generator(device=device).manual_seed(0)
    if layout == "fused":
        m = torch.randn(t, hq + 2 * hk, d, device=device, generator=gen).to(torch.bfloat16)
        q0, k0 = m[:, :hq], m[:, hq : hq + hk]
    else:
        q0, k0 = (torch.randn(1, t, h, d, device=device, generator=gen).to(torch.bfloat16) for h in (hq, hk))
    gq, gk = (torch.randn(x.shape, device=device, generator=gen).to(torch.bfloat16) for x in (q0, k0))
    ang = torch.arange(t, device=device).float()[:, None] * ref.rope_inv_freq(d, 10000.0).to(device)
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]  # [t, 1, d/2]
    setups = {"eager reference": lambda q, k: ref.rotary(q, k, cos, sin, False), "loongforge": lambda q, k: rotary(q, k, cos, sin, False)}
    if device != "cpu":
        setups["torch.compile(reference)"] = torch.compile(lambda q, k: ref.rotary(q, k, cos, sin, False), dynamic=False)
    lig = maybe(lambda: __import__("liger_kernel.ops.rope", fromlist=["LigerRopeFunction"]).LigerRopeFunction)
    if lig is not None:
        full_cos, full_sin = torch.cat([cos[:, 0]] * 2, dim=-1)[None], torch.cat([sin[:, 0]] * 2, dim=-1)[None]  # [1, t, d]

        def liger(q, k):
            q4, k4 = (x if x.dim() == 4 else x[None] for x in (q, k))
            qo, ko = lig.apply(q4.transpose(1, 2), k4.transpose(1, 2), full_cos, full_sin)
            qo, ko = qo.transpose(1, 2), ko.transpose(1, 2)
            return (qo, ko) if q.dim() == 4 else (qo[0], ko[0])

        setups["liger"] = liger
    return (q0, k0), (gq, gk), setups


def rotary_rows(shapes, copy_gbs, sweep=((8, 2), (16, 1), (16, 4), (32, 4)), device="cuda"):
    """Forward + backward of every setup on q / k in the callers' layout (strided views stay
    strided), then our forward alone at the default launch parameters (`rope.BLOCK_H` q heads per
    program, `rope.WARPS` warps) and others: the backward is the same kernel."""
    from loongforge.kernels import rotary as krot

    rows = []
    for t, hq, hk, d, layout in shapes:
        shape = f"{t}x({hq}+{hk})x{d} {layout}"
        inputs, grads, setups = rotary_setups(t, hq, hk, d, layout, device)
        errors = agreement(setups, inputs, grads, 2e-2)
        print(f"rotary q+k {shape}, relative difference to the eager reference:", {n: f"{e:.2g}" for n, e in errors.items()}, flush=True)
        q, k = (x.detach().requires_grad_(True) for x in inputs)  # leaves with the layout's strides
        grads = [g.clone() for g in grads]
        # fwd: read q/k, write q'/k'; bwd: read dq'/dk', write dq/dk; the fp32 cos / sin rows once each way
        nbytes = 4 * (q.numel() + k.numel()) * 2 + 2 * 2 * t * (d // 2) * 4
        for name in errors:
            rows.append(row("rotary q+k fwd+bwd", shape, name, fwd_bwd(setups[name], [q, k], grads), nbytes, copy_gbs, cold=True))
        ang = torch.arange(t, device=device).float()[:, None] * ref.rope_inv_freq(d, 10000.0).to(device)
        cos, sin = ang.cos(), ang.sin()  # the kernel's [t, d/2] rows
        for block_h, warps in ((krot.BLOCK_H, krot.WARPS),) + tuple(sweep):

            def fwd(block_h=block_h, warps=warps):
                krot._launch(q, k, cos, sin, False, 1.0, block_h, warps)

            rows.append(row("rotary q+k fwd", shape, f"loongforge {block_h} heads, {warps} warps", fwd, nbytes // 2, copy_gbs))
    return rows


def moe_setups(n, h, e, k, device):
    """A MoE layer's token permute (each token's k copies grouped by expert) and unpermute (the
    copies combined back, weighted by the router probabilities) around identity experts, bf16:
    eager and torch.compile of the reference, our kernels, and megatron-core's `moe_utils.permute`
    / `unpermute` (its local path: routing map and dense probabilities, no transformer-engine).
    Returns ((tokens, probs), (grad,), setups: name -> fn(tokens [n, h], probs [n, k]) -> [n, h],
    expert ids [n, k])."""
    from loongforge.kernels import moe_permute as kmoe

    gen = torch.Generator(device=device).manual_seed(0)
    x0 = torch.randn(n, h, device=device, generator=gen).to(torch.bfloat16)
    top = torch.randn(n, e, device=device, generator=gen).topk(k)
    ids, p0 = top.indices, top.values.softmax(-1)
    g0 = torch.randn(n, h, device=device, generator=gen).to(torch.bfloat16)

    def pipeline(permute, unpermute):
        def f(x, probs):
            permuted, row_ids, _ = permute(x, ids, e)
            return unpermute(permuted, row_ids, probs)

        return f

    setups = {"eager reference": pipeline(ref.moe_permute, ref.moe_unpermute), "loongforge": pipeline(kmoe.moe_permute, kmoe.moe_unpermute)}
    if device != "cpu":
        setups["torch.compile(reference)"] = torch.compile(pipeline(ref.moe_permute, ref.moe_unpermute), dynamic=False)
    mcore = maybe(lambda: __import__("megatron.core.transformer.moe.moe_utils", fromlist=["permute"]))
    if mcore is not None:
        routing_map = torch.zeros(n, e, dtype=torch.bool, device=device).scatter(1, ids, True)

        def megatron(x, probs):
            permuted, _, sorted_indices = mcore.permute(x, routing_map)
            dense = torch.zeros(n, e, dtype=probs.dtype, device=device).scatter(1, ids, probs)
            return mcore.unpermute(permuted, sorted_indices, x.shape, probs=dense, routing_map=routing_map)

        setups["megatron-core moe_utils"] = megatron
    return (x0, p0), (g0,), setups, ids


def moe_rows(shapes, copy_gbs, sweep=(2, 8), device="cuda"):
    """Forward + backward of every setup, then our permute + unpermute forward kernels alone (no
    sort) at the default number of warps (4; the hidden block is 256 columns per warp) and others."""
    from loongforge.kernels import moe_permute as kmoe

    rows = []
    for n, h, e, k in shapes:
        inputs, grads, setups, ids = moe_setups(n, h, e, k, device)
        errors = agreement(setups, inputs, grads, 2e-2)
        print(
            f"moe permute+unpermute {n}x{h}, top-{k} of {e}, relative difference to the eager reference:",
            {name: f"{err:.2g}" for name, err in errors.items()},
            flush=True,
        )
        x, probs = (t.clone().requires_grad_(True) for t in inputs)
        (g,) = grads
        # permute fwd reads n rows, writes n*k; unpermute fwd reads n*k, writes n; unpermute bwd
        # reads n (gradient) and n*k (its input, for the probabilities' gradient), writes n*k;
        # permute bwd reads n*k, writes n
        nbytes = (4 * n + 5 * n * k) * h * 2
        for name in errors:
            rows.append(
                row(
                    "moe permute+unpermute fwd+bwd",
                    f"{n}x{h} top-{k}/{e}",
                    name,
                    fwd_bwd(setups[name], [x, probs], g),
                    nbytes,
                    copy_gbs,
                    cold=True,
                )
            )
        pos = kmoe._positions(ref.moe_order(ids, e)[0], k)
        permuted = kmoe._scatter_rows(x.detach(), pos)
        for warps in (kmoe.WARPS,) + tuple(sweep):

            def fwd(warps=warps):
                kmoe._scatter_rows(x, pos, num_warps=warps)
                kmoe._combine_rows(permuted, pos, probs, num_warps=warps)

            rows.append(
                row(
                    "moe permute+unpermute fwd kernels",
                    f"{n}x{h} top-{k}/{e}",
                    f"loongforge {warps} warps",
                    fwd,
                    2 * (n + n * k) * h * 2,
                    copy_gbs,
                )
            )
    return rows


def qkv_rope_rows(shapes, copy_gbs):
    """megatron's q/k/v split + RoPE on q and k: the fused kernel against the split views with
    our RoPE kernel (the unfused model path; its backward concatenates the three gradients) and
    torch.compile / eager of the reference."""
    from loongforge.kernels.qkv_rope import qkv_rope
    from loongforge.kernels.rope import rope

    def split_then_rope(m, pos, inv, r):
        s, b, g, w = m.shape
        d = w // (r + 2)
        q, k, v = torch.split(m, [r * d, d, d], dim=3)
        q, k = rope(q.reshape(s, b, g * r, d).transpose(0, 1), k.transpose(0, 1), pos, inv)
        return q, k, v

    rows = []
    for s, b, g, r, d in shapes:
        m = torch.randn(s, b, g, (r + 2) * d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        inv = ref.rope_inv_freq(d, 500000.0).cuda()
        pos = torch.arange(s, device="cuda")
        setups = {
            "loongforge fused": lambda t: qkv_rope(t, pos, inv, r),
            "split + loongforge rope": lambda t: split_then_rope(t, pos, inv, r),
            "torch.compile(reference)": torch.compile(lambda t: ref.qkv_rope(t, pos, inv, r), dynamic=False),
            "eager reference": lambda t: ref.qkv_rope(t, pos, inv, r),
        }
        nbytes = 4 * m.numel() * 2  # fwd: read the projection, write q/k/v; bwd: the same back

        for name, fn in setups.items():

            def step(fn=fn):
                m.grad = None
                outs = fn(m)
                torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

            rows.append(row("qkv split+rope fwd+bwd", f"{s}x{b}x{g}x({r}+2)x{d}", name, step, nbytes, copy_gbs))
    return rows


def attention_layout_rows(shapes):
    """Attention (torch SDPA, causal) forward + backward with q/k/v stored seq-major ([s, b, h, d],
    megatron's order) or batch-major ([b, s, h, d]), including the output's way back to
    [s, b, h*d]: which layout the fused q/k/v kernel should write."""
    import torch.nn.functional as F

    rows = []
    for s, b, h, d in shapes:
        for layout in ("sbhd", "bshd"):

            def make():
                t = torch.randn((s, b, h, d) if layout == "sbhd" else (b, s, h, d), device="cuda", dtype=torch.bfloat16)
                return (t if layout == "sbhd" else t.transpose(0, 1)).requires_grad_(True)

            q, k, v = make(), make(), make()
            g = torch.randn(s, b, h * d, device="cuda", dtype=torch.bfloat16)

            def step():
                for t in (q, k, v):
                    t.grad = None
                out = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), is_causal=True)
                out.permute(2, 0, 1, 3).reshape(s, b, h * d).backward(g)

            rows.append(
                {
                    "kernel": "attention fwd+bwd",
                    "shape": f"{b}x{s}x{h}x{d}",
                    "setup": f"q/k/v {layout}",
                    "ms": bench(step),
                    "graph ms": bench_graph(step),
                }
            )
    return rows


def packed_attention_rows(configs):
    """Packed-sample attention forward + backward (bf16, [tokens, heads, head_dim]): torch's flash
    varlen kernel over the whole pack against SDPA per sample (core's reference; cuDNN's kernels
    on Hopper), bidirectional (`packed_attention`) or causal (`varlen_attention`). Eager times only:
    the per-sample path reads the bounds on the host."""
    from loongforge.kernels.varlen_attention import _flash

    rows = []
    for lengths, heads, groups, d, causal in configs:
        cu = torch.tensor([0, *itertools.accumulate(lengths)], device="cuda", dtype=torch.int32)
        total, longest = int(cu[-1]), max(lengths)
        q = torch.randn(total, heads, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(total, groups, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(total, groups, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(total, heads, d, device="cuda", dtype=torch.bfloat16)
        pairs = sum(n * (n + 1) // 2 if causal else n * n for n in lengths)
        flops = 3.5 * 4 * pairs * heads * d  # forward 4 * pairs * heads * d, backward 2.5x that
        setups = {
            "flash varlen": lambda q, k, v: _flash(q, k, v, cu, cu, longest, longest, causal, None),
            "SDPA per sample": (lambda q, k, v: ref.varlen_attention(q, k, v, cu, None, longest))
            if causal
            else (lambda q, k, v: ref.packed_attention(q, k, v, cu, cu, None, longest, longest)),
        }
        shape = f"{len(lengths)} x {longest}" if len(set(lengths)) == 1 else "+".join(map(str, lengths))
        for name, fn in setups.items():
            ms = bench(fwd_bwd(fn, (q, k, v), g), warmup=10, rep=50)
            rows.append(
                {
                    "kernel": f"{'causal' if causal else 'bidirectional'} packed attention fwd+bwd",
                    "shape": f"{shape}, {heads}/{groups} heads x {d}",
                    "setup": name,
                    "ms": ms,
                    "TFLOP/s": flops / ms / 1e9,
                }
            )
            print(f"  {rows[-1]['kernel']} {rows[-1]['shape']} {name}: {ms:.3f} ms, {rows[-1]['TFLOP/s']:.0f} TFLOP/s", flush=True)
    return rows


def masked_attention_rows(configs):
    """Attention under an additive mask (pi0's block mask: bf16 [b, 1, s, t]) with grouped keys and
    values (8 query heads, 1 group, head size 256), forward (+ backward where `train`): SDPA given
    the groups (`enable_gqa`, what `gemma.masked_attention` calls) against SDPA on keys and values
    repeated to every head, each with torch's choice of backend and with each backend forced."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    for b, hq, hk, s, t, d, train in configs:
        q = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=train)
        k = torch.randn(b, hk, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=train)
        v = torch.randn(b, hk, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=train)
        keep = torch.rand(b, 1, s, t, device="cuda") < 0.9
        keep[..., 0] = True
        bias = torch.zeros(b, 1, s, t, device="cuda", dtype=torch.bfloat16).masked_fill_(~keep, -2.3819763e38)
        g = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16)

        def gqa(q=q, k=k, v=v):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)

        def repeated(q=q, k=k, v=v):
            r = hq // hk
            return F.scaled_dot_product_attention(q, k.repeat_interleave(r, 1), v.repeat_interleave(r, 1), attn_mask=bias)

        setups = [("SDPA enable_gqa", gqa, None), ("SDPA repeated k/v", repeated, None)]
        for backend in (SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
            setups.append((f"repeated k/v, {backend.name}", repeated, backend))
        for name, fn, backend in setups:

            def run(fn=fn, backend=backend):
                if backend is None:
                    return fwd_bwd(fn, (q, k, v), g)() if train else fn()
                with sdpa_kernel([backend]):
                    return fwd_bwd(fn, (q, k, v), g)() if train else fn()

            try:
                run()
                ms = bench(run, warmup=10, rep=50)
            except Exception as e:  # a backend that does not take these inputs
                print(f"  {name}: unavailable ({type(e).__name__}: {str(e).splitlines()[0][:100]})", flush=True)
                continue
            rows.append(
                {
                    "kernel": f"masked attention {'fwd+bwd' if train else 'fwd'}",
                    "shape": f"{b}x{hq}/{hk}x{s}x{t}x{d}",
                    "setup": name,
                    "ms": ms,
                }
            )
            print(f"  {rows[-1]['kernel']} {rows[-1]['shape']} {name}: {ms:.3f} ms", flush=True)
    return rows


MASKED_ATTENTION_CONFIGS = (
    (32, 8, 1, 762, 762, 256, True),  # pi0.5 training: batch 32, prefix 712 + 50 actions
    (1, 8, 1, 712, 712, 256, False),  # the prefix pass of one action chunk
    (1, 8, 1, 50, 762, 256, False),  # one flow step: 50 action queries on the cached prefix
)


PACKED_ATTENTION_CONFIGS = (
    [([32760], 12, 12, 128, False), ([32760, 14040, 3600, 1560], 12, 12, 128, False)]  # Wan 1.3B: one clip, the benchmark's MIX
    + [([n] * (32768 // n), 12, 12, 128, False) for n in (16384, 8192, 4096, 2048, 1024, 512)]
    + [([64] * 256, 16, 16, 80, False), ([1024] * 16, 16, 16, 80, False)]  # a ViT's windows and images
    + [([4096], 32, 8, 128, True), ([8192], 32, 8, 128, True), ([2048] * 4, 32, 8, 128, True)]  # packed LLM samples
)


def adamw_rows(copy_gbs, num_layers=24, hidden=2048, ffn=5632, vocab=32000):
    """One AdamW update over the bf16 parameters of the 1.3B config (the tensors the trainer
    steps): the Triton kernel against torch's fused AdamW (core's reference), then a sweep of the
    kernel's launch parameters over the same tensors."""
    from loongforge.kernels import adamw as k

    shapes = [(vocab, hidden), (vocab, hidden), (hidden,)] + [
        s
        for _ in range(num_layers)
        for s in ((3 * hidden, hidden), (hidden, hidden), (2 * ffn, hidden), (hidden, ffn), (hidden,), (hidden,))
    ]
    ps = [torch.randn(s, device="cuda", dtype=torch.bfloat16) * 0.02 for s in shapes]
    gs = [torch.randn_like(p) for p in ps]
    ms, vs = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
    steps = [torch.ones((), device="cuda") for _ in ps]
    scale = torch.tensor(1.5, device="cuda")
    n = sum(p.numel() for p in ps)
    label = f"{n / 1e9:.3f}B bf16"
    rows = []
    for name, fn in (("loongforge", k.adamw), ("torch fused (reference)", ref.adamw)):

        def step(fn=fn):
            fn(ps, gs, ms, vs, steps, lr=1e-4, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8, grad_scale=scale)

        rows.append(row("adamw step", label, name, step, 14 * n, copy_gbs))
    big = [[t[i] for i, p in enumerate(ps) if k._own_launch(p, gs[i], ms[i], vs[i])] for t in (ps, gs, ms, vs, steps)]
    nbig = sum(p.numel() for p in big[0])
    for block, warps in ((512, 4), (1024, 2), (1024, 4), (2048, 4), (2048, 8), (4096, 8)):

        def sweep(block=block, warps=warps):
            k.adamw(*big, lr=1e-4, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8, grad_scale=scale, block=block, num_warps=warps)

        rows.append(row("adamw launch sweep", f"{nbig / 1e9:.3f}B bf16", f"block {block} x {warps} warps", sweep, 14 * nbig, copy_gbs))
    return rows


def sum_squares_rows(copy_gbs, num_layers=8, hidden=2048, experts=128, expert_ffn=768, qkv=5120, attn=4096, vocab=151936):
    """The gradient norm's sum of squares over the bf16 gradients of the MoE benchmark's model
    (Qwen3-30B-A3B layer shape): the Triton kernel against torch's `_foreach_norm` (core's
    reference), then a sweep of the kernel's launch parameters."""
    from loongforge.kernels import sum_squares as k

    shapes = [(vocab, hidden), (vocab, hidden), (hidden,)] + [
        s
        for _ in range(num_layers)
        for s in ((qkv, hidden), (hidden, attn), (experts, 2 * expert_ffn, hidden), (experts, hidden, expert_ffn), (experts, hidden))
        + ((128,), (128,), (hidden,), (hidden,))
    ]
    gs = [torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in shapes]
    n = sum(g.numel() for g in gs)
    label = f"{n / 1e9:.3f}B bf16"
    rows = [
        row("sum_squares", label, name, lambda fn=fn: fn(gs), 2 * n, copy_gbs)
        for name, fn in (("loongforge", k.sum_squares), ("torch _foreach_norm (reference)", ref.sum_squares))
    ]
    for block, iters, warps in ((1024, 4, 4), (1024, 8, 4), (1024, 16, 4), (2048, 8, 8), (4096, 4, 8), (4096, 8, 16)):
        rows.append(
            row(
                "sum_squares launch sweep",
                label,
                f"block {block} x {iters} x {warps} warps",
                lambda b=block, i=iters, w=warps: k.sum_squares(gs, block=b, iters=i, num_warps=w),
                2 * n,
                copy_gbs,
            )
        )
    return rows


def linear_ce_rows(copy_gbs, n=16384, h=4096, v=128256, budgets_mib=(128, 512)):
    """The fused linear + cross-entropy (logits chunks as large as the weight) against unfused
    ones (and Liger's where installed), and the fused op with other chunk sizes (`budgets_mib`:
    more chunks re-accumulate the weight gradient more often)."""
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

    setups = {
        "loongforge fused": lambda: linear_cross_entropy(hid, w, labels, tw).backward(),
        "unfused, fp32 logits": unfused(True),
        "unfused, bf16 logits": unfused(False),
    }
    for mib in budgets_mib:
        setups[f"loongforge fused, {mib} MiB logits chunks"] = lambda b=mib << 20: linear_cross_entropy(
            hid, w, labels, tw, logits_budget=b
        ).backward()
    liger = maybe(
        lambda: __import__("liger_kernel.transformers", fromlist=["LigerFusedLinearCrossEntropyLoss"]).LigerFusedLinearCrossEntropyLoss()
    )
    if liger is not None:
        setups["liger fused"] = lambda: liger(w, hid, labels).backward()
    runs, extra = {}, {}
    for name, step in setups.items():

        def run(step=step):
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
        extra[name] = (torch.cuda.max_memory_allocated() - base) / 2**30
        runs[name] = run
    # matmul-bound setups drift with the GPU's clocks: rounds alternate between the setups and
    # each setup reports the median over its rounds
    times = {name: [] for name in runs}
    for _ in range(5):
        for name, run in runs.items():
            times[name].append(bench(run, warmup=1, rep=10))
    for name in runs:
        rows.append(
            {
                "kernel": "linear+CE fwd+bwd",
                "shape": f"{n}x{h}x{v}",
                "setup": name,
                "ms": sorted(times[name])[2],
                "graph ms": None,
                "extra GiB": extra[name],
            }
        )
    for name in ("loongforge fused", "liger fused"):
        if name in runs:
            kernel_breakdown(name, runs[name])
    hid.grad = None
    w.grad = None
    return rows + ce_rows_sweep(min(n, 512), v, copy_gbs)


def kernel_breakdown(name, run, top=6):
    """Where one call's GPU time goes, by kernel (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    from profile_step import idle_gaps

    events = sorted((e for e in prof.key_averages() if e.self_device_time_total > 0), key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in events) / 1e3
    print(f"{name}: {total:.1f} ms of kernels", flush=True)
    for e in events[:top]:
        print(f"  {e.self_device_time_total / 1e3:8.2f} ms  x{e.count:<4} {e.key[:110]}", flush=True)
    idle_gaps(prof, 1, top=4)


def ce_rows_sweep(rows_n, v, copy_gbs):
    """The fused op's per-row softmax/gradient kernel alone on one chunk of bf16 logits (read
    twice, written once), over its launch parameters."""
    from loongforge.kernels import linear_cross_entropy as lce

    logits = torch.randn(rows_n, v, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, v, (rows_n,), device="cuda")
    tw = torch.full((rows_n,), 1.0 / rows_n, device="cuda")
    loss = torch.empty(rows_n, device="cuda")
    out = []
    for block_v, warps in ((2048, 8), (4096, 8), (4096, 16), (8192, 16), (8192, 32), (16384, 16), (16384, 32), (32768, 32)):

        def step(block_v=block_v, warps=warps):
            lce.ce_rows(logits, labels, tw, loss, -100, 0.0, True, block_v=block_v, num_warps=warps)

        out.append(row("CE rows (in place)", f"{rows_n}x{v}", f"block {block_v} x {warps} warps", step, 3 * logits.numel() * 2, copy_gbs))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--only",
        default="rms_norm,swiglu,rope,rotary,qkv_rope,moe,attention_layout,adamw,sum_squares,linear_ce,linear_ce_moe",
        help="comma-separated parts (also gemma, packed_attention, masked_attention); gemma: Gemma's norm and GeGLU at pi0.5's shape; linear_ce_moe: the fused loss at the MoE benchmark's shape (4096 x 2048 x 151936)",
    )
    p.add_argument("--quick", action="store_true", help="one small shape per kernel")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth()
    print(
        f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; copy {copy_gbs:.0f} GB/s", flush=True
    )
    shapes = [(t, h) for h in (2048, 4096, 8192) for t in (8192, 32768)] if not a.quick else [(8192, 2048)]
    rows = []
    only = a.only.split(",")
    if "rms_norm" in only:
        rows += rms_norm_rows(shapes, copy_gbs)
    if "swiglu" in only:
        rows += gated_rows("swiglu", [(t, f) for t in (8192, 32768) for f in (5632, 14336)] if not a.quick else [(8192, 5632)], copy_gbs)
    if "gemma" in only:  # pi0.5's backbone at batch 32: 32 x 712 tokens, hidden 2048, ffn 16384
        rows += gemma_rms_norm_rows([(22784, 2048)], copy_gbs)
        rows += gated_rows("geglu", [(22784, 16384)] if not a.quick else [(8192, 5632)], copy_gbs)
    if "rope" in only:
        rows += rope_rows(
            [(4, 2048, 16, 16, 128), (1, 8192, 32, 8, 128), (4, 8192, 32, 8, 128)] if not a.quick else [(4, 2048, 16, 16, 128)], copy_gbs
        )
    if "rotary" in only:
        rows += rotary_rows(
            [(4096, 28, 4, 128, "1thd"), (16384, 16, 16, 80, "fused")] if not a.quick else [(4096, 28, 4, 128, "1thd")], copy_gbs
        )
    if "qkv_rope" in only:
        rows += qkv_rope_rows([(2048, 4, 16, 1, 128), (4096, 1, 8, 4, 128)] if not a.quick else [(2048, 4, 16, 1, 128)], copy_gbs)
    if "moe" in only:
        rows += moe_rows(
            [(8192, 4096, 8, 2), (32768, 4096, 8, 2), (8192, 2048, 128, 8), (32768, 2048, 128, 8)] if not a.quick else [(2048, 1024, 8, 2)],
            copy_gbs,
        )
    if "attention_layout" in only:
        rows += attention_layout_rows([(2048, 4, 16, 128)] if not a.quick else [(512, 2, 4, 64)])
    if "adamw" in only:
        rows += adamw_rows(copy_gbs) if not a.quick else adamw_rows(copy_gbs, num_layers=2)
    if "sum_squares" in only:
        rows += sum_squares_rows(copy_gbs) if not a.quick else sum_squares_rows(copy_gbs, num_layers=1)
    if "linear_ce" in only:
        rows += linear_ce_rows(copy_gbs) if not a.quick else linear_ce_rows(copy_gbs, 2048, 1024, 32000)
    if "packed_attention" in only:
        rows += packed_attention_rows(PACKED_ATTENTION_CONFIGS if not a.quick else PACKED_ATTENTION_CONFIGS[:2])
    if "masked_attention" in only:
        rows += masked_attention_rows(MASKED_ATTENTION_CONFIGS)
    if "linear_ce_moe" in only:
        rows += linear_ce_rows(copy_gbs, 4096, 2048, 151936, budgets_mib=(128, 512, 2048))
    print(
        "\n| kernel | shape | setup | ms | graph ms | cold graph ms | GB/s | of copy | extra GiB |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    for r in rows:
        gms = f"{r['graph ms']:.3f}" if r.get("graph ms") is not None else ""
        cms = f"{r['cold graph ms']:.3f}" if r.get("cold graph ms") is not None else ""
        gbs = f"{r['GB/s']:.0f}" if "GB/s" in r else ""
        frac = f"{100 * r['of copy']:.0f}%" if "of copy" in r else ""
        mem = f"{r['extra GiB']:.2f}" if "extra GiB" in r else ""
        print(f"| {r['kernel']} | {r['shape']} | {r['setup']} | {r['ms']:.3f} | {gms} | {cms} | {gbs} | {frac} | {mem} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "copy_GBs": copy_gbs, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
