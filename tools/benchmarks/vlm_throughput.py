"""VLM training throughput on one GPU: LoongForge's Qwen2.5-VL (`vlm.sft`'s task: core's vision
tower and the megatron-core Qwen2 language model with M-RoPE, one THD pack per step) against HF
transformers' `Qwen2_5_VLForConditionalGeneration` (eager, and torch.compile where it compiles),
same shape, same tokens and pixels, same process.

    python tools/benchmarks/vlm_throughput.py                          # Qwen2.5-VL-7B shape
    python tools/benchmarks/vlm_throughput.py --layers 4 --vit-depth 4 --steps 3 --warmup 1   # smoke run

Shape: Qwen2.5-VL-7B (ViT: 32 blocks of width 1280, 16 heads, window 112 px with full attention in
blocks 7/15/23/31, patch merger to 3584; language model: 28 layers of 3584, 28 / 4 heads, FFN
18944, vocab 152064, M-RoPE sections 16/24/24). One sample per step: `--seq` tokens of which
`--images` images of `--image-size` px (448: 32x32 patches -> 256 merged tokens each) and the
rest text; loss on every token. Pure bf16 on both sides (bf16 parameters, gradients and AdamW
state; HF `.bfloat16()` with fused AdamW; ours the trainer's `master_weights=false`), clipping
at 1.0, no recompute. Each setup trains `--warmup` steps untimed, then `--steps` timed ones (CUDA
events): ms/step, tokens/s, MFU against 989 TFLOP/s (dense bf16), peak memory.

FLOPs per step: the language model's `flops_per_token(seq)` (6 x params + 12 x layers x hidden x seq
per token) times the tokens, plus the ViT's 6 x params x patches + 12 x depth x width x (window or
image length) x patches (non-causal; the merger counted in its params).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from llm_throughput import profile_shares, timed  # noqa: E402

IMG, VID, START, END = 151655, 151656, 151652, 151653


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--vit-depth", type=int, default=32)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--images", type=int, default=4)
    p.add_argument("--image-size", type=int, default=448)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--setups", default="loongforge (pure bf16),hf eager,hf compile")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--in-process", action="store_true", help="run every setup in this process (default: a fresh process each)")
    return p.parse_args()


def isolated(a) -> None:
    """Each setup in a fresh process (an earlier setup's freed memory cannot crowd a later one
    out), then the joint table."""
    import os
    import subprocess

    results, shares, gpu = {}, None, None
    for name in [s.strip() for s in a.setups.split(",")]:
        out = tempfile.mktemp(suffix=".json")
        argv = [a2 for a2 in sys.argv[1:]]
        for flag in ("--setups", "--json"):
            if flag in argv:
                i = argv.index(flag)
                del argv[i : i + 2]
        subprocess.run([sys.executable, __file__, *argv, "--in-process", "--setups", name, "--json", out], check=False)
        if os.path.exists(out):
            got = json.load(open(out))
            results.update(got["results"])
            shares, gpu = shares or got["shares"], got["gpu"]
        else:
            results[name] = None
    report(results, shares, a, gpu)


def report(results: dict, shares, a, gpu: str) -> None:
    print("\n| setup | ms/step | tokens/s | MFU (of 989) | peak GiB |")
    print("| --- | --- | --- | --- | --- |")
    for n, r in results.items():
        if r is None:
            print(f"| {n} | failed (see above) | | | |")
            continue
        print(f"| {n} | {r['ms_per_step']:.1f} | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f}% | {r['peak_gib']:.1f} |")
    ours = results.get("loongforge (pure bf16)")
    if ours:
        for b in ("hf eager", "hf compile"):
            if results.get(b):
                print(f"ratio loongforge (pure bf16) / {b}: {ours['tokens_per_s'] / results[b]['tokens_per_s']:.2f}x tokens/s")
    if shares:
        print("shares of our step's GPU time: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in shares.items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": vars(a), "results": results, "shares": shares, "gpu": gpu}, f, indent=1)


def configs(a):
    from loongforge.core.foundation.qwen2_5_vl_vision import Qwen25VisionConfig
    from loongforge.core.foundation.spec import ModelConfig
    from loongforge.vlm.model import VLMConfig

    full = [i for i in (7, 15, 23, 31) if i < a.vit_depth]
    vision = Qwen25VisionConfig(
        depth=a.vit_depth,
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        patch_size=14,
        window_size=112,
        out_hidden_size=3584,
        fullatt_block_indexes=full,
    )
    language = ModelConfig(
        family="qwen2",
        num_layers=a.layers,
        hidden_size=3584,
        num_attention_heads=28,
        num_query_groups=4,
        ffn_hidden_size=18944,
        vocab_size=152064,
        max_position_embeddings=32768,
        rope_theta=1e6,
        norm_eps=1e-6,
        mrope_section=[16, 24, 24],
        qkv_bias=True,
        qk_norm=False,
    )
    return VLMConfig(
        vision=dataclasses.asdict(vision),
        language=language,
        image_token_id=IMG,
        video_token_id=VID,
        vision_start_token_id=START,
        vision_end_token_id=END,
    )


def inputs(a, cfg, device):
    """One sample: text, then each image as start + pads + end, text to `--seq` tokens."""
    side = a.image_size // cfg.tower.patch_size
    merged = side * side // 4
    g = torch.Generator().manual_seed(0)
    text = a.seq - a.images * (merged + 2)
    if text < 2:
        raise SystemExit(f"--seq {a.seq} is too short for {a.images} images of {merged} tokens")
    per = text // (a.images + 1)
    ids = []
    for _ in range(a.images):
        ids += torch.randint(0, 150000, (per,), generator=g).tolist() + [START] + [IMG] * merged + [END]
    ids += torch.randint(0, 150000, (a.seq - len(ids),), generator=g).tolist()
    ids = torch.tensor(ids, device=device)[None]
    grid = torch.tensor([[1, side, side]] * a.images, device=device)
    pixels = torch.randn(a.images * side * side, cfg.tower.patch_dim, generator=g).to(device, torch.bfloat16)
    return ids, grid, pixels


def vit_flops(cfg, grid) -> float:
    v = cfg.tower
    d, f = v.hidden_size, v.intermediate_size
    merged_in = d * 4
    params = v.patch_dim * d + v.depth * (4 * d * d + 3 * d * f) + merged_in * merged_in + merged_in * v.out_hidden_size
    patches = int(grid.prod(1).sum())
    window = (v.window_size // v.patch_size) ** 2
    image = int(grid[0].prod())
    full = len(v.fullatt_block_indexes)
    attn = 12 * d * patches * (full * image + (v.depth - full) * min(window, image))
    return 6.0 * params * patches + attn


def ours_step(cfg, ids, grid, pixels):
    """`Trainer.train_step` of the vlm.sft task on one fixed pack."""
    from loongforge.core.accelerator import get_accelerator
    from loongforge.core.config import CheckpointConfig, ParallelConfig, TrainConfig
    from loongforge.core.ops import OpTable
    from loongforge.core.registry import registry
    from loongforge.core.stacks.build import build_stack
    from loongforge.core.train.trainer import Trainer
    from loongforge.vlm.config import VLMRunConfig
    from loongforge.vlm.recipe import VLMTask

    acc = get_accelerator("cuda")
    seq = ids.shape[1]
    train = TrainConfig(
        micro_batch_size=1,
        global_batch_size=1,
        train_iters=1 << 30,
        lr=1e-4,
        lr_warmup_iters=0,
        params_dtype="bfloat16",
        master_weights=False,
    )
    par = ParallelConfig(stack="megatron")
    run = VLMRunConfig(model=cfg, parallel=par, train=train, checkpoint=CheckpointConfig(run_dir=tempfile.mkdtemp(), export_hf=False))
    run.data.seq_length = seq
    stack, ctx = build_stack(par, train, acc, torch.bfloat16)
    ops = OpTable.build(None, registry(), "cuda")
    task = VLMTask(run, cfg, None, stack, ctx, ops, [], acc.device(), Path(run.checkpoint.run_dir))
    trainer = Trainer(train, run.checkpoint, stack, acc, task, {}, "benchmark", ops)
    trainer.setup()
    from loongforge.vlm.model import sample_positions

    types = torch.zeros_like(ids[0])
    types[ids[0] == IMG] = 1
    positions, _ = sample_positions(cfg, types.cpu(), grid.cpu())
    labels = torch.cat([ids[0, 1:], ids.new_zeros(1)])[None]
    weights = torch.ones_like(ids, dtype=torch.float)
    weights[0, -1] = 0
    pack = {  # the task's packs live on the host; each step moves one as the task's batches do
        "tokens": ids.cpu(),
        "labels": labels.cpu(),
        "loss_weights": weights.cpu(),
        "positions": positions,
        "cu_seqlens": torch.tensor([0, seq], dtype=torch.int32),
        "pixel_values": pixels.cpu(),
        "image_grid_thw": grid.cpu(),
    }

    def step():
        trainer.train_step([task.device_pack(pack)])

    return step, trainer


def hf_step(cfg, ids, grid, pixels, compile_: bool):
    import transformers
    from loongforge.core.foundation.families import QWEN2
    from loongforge.vlm.model import hf_config

    hc = transformers.Qwen2_5_VLConfig(**hf_config(cfg, QWEN2, torch.bfloat16))
    hc._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.Qwen2_5_VLForConditionalGeneration(hc).bfloat16().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    fwd = torch.compile(model) if compile_ else model
    types = torch.zeros_like(ids)
    types[ids == IMG] = 1

    def step():
        opt.zero_grad(set_to_none=True)
        loss = fwd(input_ids=ids, labels=ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=types).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()

    return step, (model, opt, fwd)


CATEGORIES = (
    ("attention", ("flash", "fmha", "attention", "Attention")),
    ("gemm", ("gemm", "Gemm", "sm90_xmma", "cutlass", "nvjet")),
)


def host_syncs(step) -> None:
    """Where one step makes the host wait for the GPU (torch's sync debug mode), by source line."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    seen: dict[str, int] = {}
    for w in caught:
        if "synchroniz" in str(w.message):
            seen[f"{w.filename}:{w.lineno}"] = seen.get(f"{w.filename}:{w.lineno}", 0) + 1
    print(f"  host syncs in one step: {sum(seen.values())}" + "".join(f"\n    {n}x {where}" for where, n in seen.items()), flush=True)


def main():
    a = parse()
    if not a.in_process:
        return isolated(a)
    logging.getLogger("megatron").setLevel(logging.ERROR)
    cfg = configs(a)
    ids, grid, pixels = inputs(a, cfg, "cuda")
    seq = ids.shape[1]
    flops = cfg.language.flops_per_token(seq) * seq + vit_flops(cfg, grid.cpu())
    vit_share = vit_flops(cfg, grid.cpu()) / flops
    peak = 989e12
    builders = {
        "loongforge (pure bf16)": lambda: ours_step(cfg, ids, grid, pixels),
        "hf eager": lambda: hf_step(cfg, ids, grid, pixels, False),
        "hf compile": lambda: hf_step(cfg, ids, grid, pixels, True),
    }
    print(
        f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, {seq} tokens/step with {a.images} images of "
        f"{a.image_size}px ({int(grid.prod(1).sum())} patches), {flops / 1e12:.1f} TFLOP/step (ViT {100 * vit_share:.1f}%)",
        flush=True,
    )
    results, shares = {}, None
    for name in [s.strip() for s in a.setups.split(",")]:
        t0 = time.time()
        try:
            step, keep = builders[name]()
            ms, mem = timed(step, a.warmup, a.steps)
            if name.startswith("loongforge"):
                vision = keep.model.vision  # the trainer's model

                def vit_step():
                    vision(pixels, grid.cpu()).float().square().mean().backward()

                vit_ms, _ = timed(vit_step, 1, a.steps)
                print(f"  of which the ViT (forward + backward alone): {vit_ms:.1f} ms ({100 * vit_ms / ms:.1f}% of the step)", flush=True)
                if not a.no_profile:
                    shares = profile_shares(step, CATEGORIES)
                host_syncs(step)
            del step, keep
        except Exception as e:  # report the setup as failed (out of memory included) and go on
            print(f"{name}: failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
            results[name] = None
            gc.collect()
            torch.cuda.empty_cache()
            continue
        tps = seq / (ms / 1e3)
        results[name] = {"ms_per_step": ms, "tokens_per_s": tps, "mfu": flops / (ms / 1e3) / peak, "peak_gib": mem}
        print(
            f"{name}: {ms:.1f} ms/step, {tps:,.0f} tok/s, {100 * results[name]['mfu']:.1f}% MFU, peak {mem:.1f} GiB ({time.time() - t0:.0f}s)",
            flush=True,
        )
        gc.collect()
        torch.cuda.empty_cache()
    report(results, shares, a, torch.cuda.get_device_name())


if __name__ == "__main__":
    main()
