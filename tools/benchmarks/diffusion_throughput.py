"""Wan training throughput on one GPU: LoongForge's Wan transformer through `Trainer.train_step`
against diffusers' WanTransformer3DModel (eager and torch.compile), same shape, same precision,
same process.

    python tools/benchmarks/diffusion_throughput.py                       # Wan2.1-T2V-1.3B, 81x480x832
    python tools/benchmarks/diffusion_throughput.py --layers 2 --steps 2 --warmup 1   # a smoke run

Shape: Wan2.1-T2V-1.3B (hidden 1536, 12 heads, FFN 8960, 30 layers, text width 4096) on latents
of an 81x480x832 video (16 x 21 x 60 x 104: 32,760 patch tokens) with 512 text tokens, batch 1.
Every setup: pure bf16 (bf16 parameters, gradients and AdamW state), one flow-matching step
(noise, mix at a random sigma, MSE to the velocity), backward, AdamW (fused / op `adamw`), with or
without full activation recompute on both sides (`--recompute`). Each setup trains `--warmup`
steps untimed, then `--steps` timed steps (CUDA events around the loop): ms/step, tokens/s,
TFLOP/s, MFU against 989 TFLOP/s dense bf16, peak memory. FLOPs: `WanConfig.train_flops` (the
matmuls and both attentions, forward + backward = 3x forward; recompute not counted).

Setups:
- `loongforge trainer`: the `diffusion.wan` task's loss in `Trainer.train_step` on the torch
  stack (one GPU, FSDP2 wrapping, GPU op table); `+ compile`: `parallel.compile=true` (each block
  compiled).
- `diffusers eager` / `diffusers compile`: WanTransformer3DModel `.to(bfloat16)`, fused AdamW;
  compile: `torch.compile` of the model. Recompute: `enable_gradient_checkpointing()`.
- `loongforge mix packed` / `loongforge mix padded`: the same step on a mixed batch (`MIX`: an
  81-frame, a 33-frame and a 17-frame clip and an image, 51,960 patch tokens) packed as the
  trainer packs it, against the same four samples zero-padded to the largest (131,040 tokens),
  the cost a trainer that pads would pay. tokens/s and MFU of both rows count the real tokens
  (useful work). `loongforge mix packed per-sample SDPA`: the packed step with the op table's
  `packed_attention` set to core's reference (SDPA over each sample in turn) instead of the flash
  varlen kernel over the whole pack.
Then a profile of our step gives the attention share of the GPU time.
"""

from __future__ import annotations

import argparse
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

PEAK = 989e12


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--frames", type=int, default=21, help="latent frames")
    p.add_argument("--height", type=int, default=60, help="latent height")
    p.add_argument("--width", type=int, default=104, help="latent width")
    p.add_argument("--text-len", type=int, default=512)
    p.add_argument("--recompute", action="store_true", help="full activation recompute on every side")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--setups", default="loongforge trainer,diffusers eager,loongforge trainer + compile,diffusers compile")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--json", default=None)
    return p.parse_args()


def wan_config(a):
    from loongforge.diffusion.models.wan import WanConfig

    return WanConfig(
        num_attention_heads=12,
        attention_head_dim=128,
        in_channels=16,
        out_channels=16,
        text_dim=4096,
        freq_dim=256,
        ffn_dim=8960,
        num_layers=a.layers,
    )


class Samples(list):
    """An in-memory latent dataset (the task reads `meta` and `get`)."""

    def __init__(self, latents: list, text):
        super().__init__([{"latents": x, "text": text, "caption": ""} for x in latents])
        self.meta = {"latent_channels": latents[0].shape[0], "text_dim": text.shape[1]}

    def get(self, i):
        return self[i]


# The mixed batch of the packing rows: latent grids (frames, height, width) of an 81x480x832 clip,
# a 33x480x832 clip, a 17x320x576 clip and a 480x832 image (51,960 patch tokens packed; padded to
# the largest, 4 x 32,760 = 131,040)
MIX = [(21, 60, 104), (9, 60, 104), (5, 40, 72), (1, 60, 104)]


def loongforge_step(cfg, latents, text, recompute: bool, compile_: bool, samples: list | None = None, op_choices=None):
    from loongforge.core.accelerator import get_accelerator
    from loongforge.core.config import CheckpointConfig, ParallelConfig, TrainConfig
    from loongforge.core.ops import OpTable
    from loongforge.core.registry import registry
    from loongforge.core.stacks.build import build_stack
    from loongforge.core.train.trainer import Trainer
    from loongforge.diffusion.config import WanRunConfig
    from loongforge.diffusion.task import WanTask

    acc = get_accelerator("cuda")
    samples = samples or [latents]
    train = TrainConfig(
        micro_batch_size=len(samples), global_batch_size=len(samples), train_iters=1 << 30, lr=1e-5, lr_warmup_iters=0, weight_decay=0.0,
        params_dtype="bfloat16", master_weights=False, recompute=recompute,
    )  # fmt: skip
    par = ParallelConfig(stack="torch", data_parallel_mode="fsdp", compile=compile_)
    run = WanRunConfig(model=cfg, parallel=par, train=train, checkpoint=CheckpointConfig(run_dir=tempfile.mkdtemp(), export_hf=False))
    run.data.text_len = text.shape[0]
    run.flow.caption_dropout = 0.0
    stack, _ = build_stack(par, train, acc, torch.bfloat16)
    ops = OpTable.build(op_choices, registry(), "cuda")
    task = WanTask(run, Samples(samples, text), text[:1], 0, 1, acc.device(), ops)
    trainer = Trainer(train, run.checkpoint, stack, acc, task, {}, "benchmark", ops)
    trainer.setup()
    mb = task.micro_batch(list(range(len(samples))))

    def step():
        trainer.train_step([mb])

    return step, trainer


def diffusers_step(cfg, latents, text, recompute: bool, compile_: bool):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(**{k: v for k, v in cfg.diffusers_config().items() if not k.startswith("_")})
    model = model.to("cuda", torch.bfloat16).train()
    if recompute:
        model.enable_gradient_checkpointing()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0, fused=True)
    fwd = torch.compile(model) if compile_ else model
    x0 = latents[None].to(torch.bfloat16)
    ctx = text[None].to(torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)

    def step():
        sigma = torch.rand(1, generator=g, device="cuda")
        noise = torch.randn(x0.shape, generator=g, device="cuda", dtype=x0.dtype)
        x_t = ((1 - sigma) * x0 + sigma * noise).to(torch.bfloat16)
        pred = fwd(x_t, sigma * 1000, ctx, return_dict=False)[0]
        loss = (pred.float() - (noise - x0).float()).square().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, (model, opt)


def main():
    a = parse()
    logging.getLogger("diffusers").setLevel(logging.ERROR)
    cfg = wan_config(a)
    torch.manual_seed(0)
    latents = torch.randn(16, a.frames, a.height, a.width, device="cuda")
    text = torch.randn(a.text_len, 4096, device="cuda")
    tokens = a.frames * (a.height // 2) * (a.width // 2)
    flops = cfg.train_flops(tokens, a.text_len)
    mix_sizes = [f * (h // 2) * (w // 2) for f, h, w in MIX]
    mix_tokens, mix_flops = sum(mix_sizes), sum(cfg.train_flops(n, a.text_len) for n in mix_sizes)
    builders = {
        "loongforge trainer": lambda: loongforge_step(cfg, latents, text, a.recompute, False),
        "loongforge trainer + compile": lambda: loongforge_step(cfg, latents, text, a.recompute, True),
        "diffusers eager": lambda: diffusers_step(cfg, latents, text, a.recompute, False),
        "diffusers compile": lambda: diffusers_step(cfg, latents, text, a.recompute, True),
        "loongforge mix packed": lambda: loongforge_step(cfg, latents, text, a.recompute, False, mix),
        "loongforge mix packed per-sample SDPA": lambda: loongforge_step(
            cfg, latents, text, a.recompute, False, mix, {"packed_attention": "reference"}
        ),
        "loongforge mix padded": lambda: loongforge_step(cfg, latents, text, a.recompute, False, padded),
    }
    mix = [torch.randn(16, *g, device="cuda") for g in MIX]
    big = tuple(max(g[i] for g in MIX) for i in range(3))
    padded = [torch.nn.functional.pad(x, (0, big[2] - x.shape[3], 0, big[1] - x.shape[2], 0, big[0] - x.shape[1])) for x in mix]
    names = [s.strip() for s in a.setups.split(",")]
    unknown = [n for n in names if n not in builders]
    if unknown:
        raise SystemExit(f"unknown setups {unknown}; choose from: {', '.join(builders)}")
    print(
        f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, {cfg.num_layers} layers, {tokens} tokens + {a.text_len} text, "
        f"{flops / 1e12:.1f} TFLOP/step, recompute {a.recompute}",
        flush=True,
    )
    results, share = {}, None
    for name in names:
        t0 = time.time()
        try:
            step, keep = builders[name]()
            ms, mem = timed(step, a.warmup, a.steps)
            if name == "loongforge trainer" and not a.no_profile:
                share = profile_shares(step, (("attention", ("flash", "fmha", "attention", "Attention")),), steps=2)["attention"]
            del step, keep
        except Exception as e:  # out of memory included: report the setup and go on
            print(f"{name}: failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
            results[name] = None
            gc.collect()
            torch.cuda.empty_cache()
            continue
        n_tok, n_flops = (mix_tokens, mix_flops) if name.startswith("loongforge mix") else (tokens, flops)
        results[name] = {"ms_per_step": ms, "tokens_per_s": n_tok / (ms / 1e3), "mfu": n_flops / (ms / 1e3) / PEAK, "peak_gib": mem}
        print(f"{name}: {ms:.1f} ms/step, {100 * results[name]['mfu']:.1f}% MFU, peak {mem:.1f} GiB ({time.time() - t0:.0f}s)", flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    print("\n| setup | ms/step | tokens/s | MFU (of 989) | peak GiB |")
    print("| --- | --- | --- | --- | --- |")
    for n, r in results.items():
        if r is None:
            print(f"| {n} | failed (see above) | | | |")
        else:
            print(f"| {n} | {r['ms_per_step']:.1f} | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f}% | {r['peak_gib']:.1f} |")
    if results.get("loongforge mix packed") and results.get("loongforge mix padded"):
        r = results["loongforge mix padded"]["ms_per_step"] / results["loongforge mix packed"]["ms_per_step"]
        print(f"mixed batch ({len(MIX)} samples, {mix_tokens:,} patch tokens): packed {r:.2f}x faster than padded to the largest")
    for ours in ("loongforge trainer", "loongforge trainer + compile"):
        for base in ("diffusers eager", "diffusers compile"):
            if results.get(ours) and results.get(base):
                print(f"ratio {ours} / {base}: {results[base]['ms_per_step'] / results[ours]['ms_per_step']:.2f}x")
    if share is not None:
        print(f"attention share of our step's GPU time: {100 * share:.1f}%")
    if a.json:
        Path(a.json).write_text(json.dumps({"results": results, "attention_share": share, "args": vars(a)}, indent=1))


if __name__ == "__main__":
    main()
