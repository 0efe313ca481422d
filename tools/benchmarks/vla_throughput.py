"""pi0.5 training throughput and action-chunk latency: LoongForge's `PiPolicy` against LeRobot's
`PI05Policy` (lerobot 0.4.4) in one run on one GPU.

Shape of the paper's model: PaliGemma (SigLIP So400m/14 at 224, Gemma 2B) plus the 300M action
expert, batch 32, 2 cameras, a 200-token prompt, action chunk 50 (32-wide), AdamW (betas 0.9 / 0.95,
weight decay 0.01) with gradient clipping at 1.0 on both sides, each side's update as its trainer
runs it (LeRobot: torch.optim.AdamW and clip_grad_norm_; ours: TableAdamW with the op table's
`adamw` and `sum_squares`, clipping inside the update), no activation recompute unless `--recompute`
(then each side's own: LeRobot's `gradient_checkpointing_enable()`, which recomputes each joint
layer, the final norms and the image and language embeddings, the vision tower as one piece; our
trainer's per-block recompute of `PiPolicy.blocks()`, as `train.recompute: true` sets it up), no
torch.compile unless `--compile` (then both sides also run compiled, in torch.compile's default
mode: LoongForge's loss and denoising step, LeRobot's forward and sample_actions as its
`compile_model` option compiles them). Precision:
LeRobot's `dtype="bfloat16"` on both sides: bf16 weights, with the patch and position embeddings,
the Gemma norms (the adaptive norms' linears too), the action projections and the time MLP in fp32.
LeRobot runs through the harness of tools/oracles/pi_vs_lerobot.py (the adaRMS patch of transformers
4.53.2 it needs; see there for the wheels to install into `--site`).

    python tools/benchmarks/vla_throughput.py --site /tmp/site_lr [--steps 10] [--batch 32] [--recompute]
        [--compile [--compiled-only] [--compiled-step-only]]

Prints samples/s and peak memory of a training step, and the latency of one action chunk (10
flow steps, batch 1), for each side and their ratios. On CUDA the chunk is also timed as one CUDA
graph replay on both sides (`GraphedCall` over our `sample_actions` and over LeRobot's: the same
kernels as each side's eager chunk, launched at once).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, warmup: int, iters: int) -> list[float]:
    for _ in range(warmup):
        fn()
    sync()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


ADAMW = dict(lr=2.5e-5, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)


def train_step_fn(loss_fn, params, action_dim: int):
    """LeRobot's update: torch.optim.AdamW as its AdamWConfig builds it, torch's clip_grad_norm_."""
    params = [p for p in params if p.requires_grad]
    opt = torch.optim.AdamW(params, **ADAMW)

    def step():
        loss = loss_fn()[:, :, :action_dim].float().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def trainer_step_fn(loss_fn, params, action_dim: int, ops):
    """Our trainer's update (the same AdamW and clipping at 1.0): `TableAdamW` with the op table's
    `adamw`, the gradient norm through its `sum_squares`, clipping and the NaN/Inf guard applied
    inside the update by `clipped_step`."""
    from loongforge.core.stacks.grads import grad_sq_norm
    from loongforge.core.train.optimizer import TableAdamW
    from loongforge.core.train.trainer import clipped_step

    params = [p for p in params if p.requires_grad]
    opt = TableAdamW(params, update=ops.adamw, sum_squares=ops.sum_squares, **ADAMW)

    def step():
        loss = loss_fn()[:, :, :action_dim].float().mean()
        loss.backward()
        clipped_step(opt, grad_sq_norm(params, loss.device, opt.sum_squares).sqrt(), 1.0, loss)
        opt.zero_grad(set_to_none=True)

    return step


def chunk_latency(name: str, infer, args) -> dict:
    """A row of the action-chunk latency alone (the training step is another row's)."""
    lat = timed(infer, 2, args.latency_iters)
    nan = float("nan")
    return {"name": name, "step_ms": nan, "samples_per_s": nan, "peak_gib": nan, "chunk_latency_ms": 1e3 * statistics.median(lat)}


def measure(name: str, step, infer, batch: int, args) -> dict:
    """A row of the training step's samples/s and peak memory, and of the chunk latency of `infer`
    (none where `infer` is None)."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = timed(step, args.warmup, args.steps)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    lat = timed(infer, 2, args.latency_iters) if infer is not None else [float("nan")]
    row = {
        "name": name,
        "step_ms": 1e3 * statistics.median(times),
        "samples_per_s": batch / statistics.median(times),
        "peak_gib": peak,
        "chunk_latency_ms": 1e3 * statistics.median(lat),
        "step_ms_all": [round(1e3 * t, 2) for t in times],
    }
    print(json.dumps(row), flush=True)
    return row


PROFILE_CATEGORIES = (
    ("attention", ("fmha", "flash", "attention", "Attention", "sdpa")),
    ("GEMM", ("gemm", "nvjet", "cutlass", "Gemm")),
    ("optimizer", ("multi_tensor", "foreach", "adam", "sum_squares")),
    ("norms and activations (our kernels)", ("_rms_norm", "_gated")),
)


def print_profile(whose: str, step) -> None:
    """The top kernels of `step` and the shares of its GPU time by PROFILE_CATEGORIES."""
    from llm_throughput import profile_shares

    shares = profile_shares(
        step, PROFILE_CATEGORIES, steps=2, top=25, ops=("aten::copy_", "aten::cat", "aten::add", "aten::add_", "aten::sum")
    )
    print(f"shares of {whose} eager step's GPU time: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in shares.items()), flush=True)


def run_ours(args, rows, dev, b, size, chunk, action_dim, images, image_masks, tokens, token_masks, actions, one) -> None:
    from loongforge.core.foundation.gemma import GemmaConfig
    from loongforge.core.foundation.siglip import SiglipVisionConfig
    from loongforge.embodied.policies import Observation, PiConfig, PiPolicy

    gemma = dict(num_layers=18, num_attention_heads=8, num_query_groups=1, head_dim=256, vocab_size=257152)
    cfg = PiConfig(
        variant="pi05",
        vision=SiglipVisionConfig(
            num_layers=27, hidden_size=1152, num_attention_heads=16, ffn_hidden_size=4304, image_size=224, patch_size=14
        ),
        backbone=GemmaConfig(**gemma, hidden_size=2048, ffn_hidden_size=16384),
        expert=GemmaConfig(**gemma, hidden_size=1024, ffn_hidden_size=4096, adarms_cond_dim=1024),
        chunk_size=chunk,
    )
    if args.tiny:
        shared = dict(num_layers=2, num_attention_heads=8, num_query_groups=1, head_dim=16, vocab_size=257152)
        cfg = PiConfig(
            vision=SiglipVisionConfig(
                num_layers=2, hidden_size=32, num_attention_heads=2, ffn_hidden_size=4304, image_size=size, patch_size=14
            ),
            backbone=GemmaConfig(**shared, hidden_size=2048, ffn_hidden_size=64),
            expert=GemmaConfig(**shared, hidden_size=64, ffn_hidden_size=96, adarms_cond_dim=64),
            chunk_size=chunk,
        )
    from loongforge.core.ops import OpTable
    from loongforge.core.registry import registry

    ops = OpTable.build(None, registry(), dev)
    with torch.device(dev):  # with the op table `loongforge-embodied train` builds for the device
        ours = PiPolicy(cfg, ops).to(torch.bfloat16)
    # the parameters LeRobot keeps in fp32 in its bf16 mode, kept so here too
    for m in (
        ours.vision.patch_embed,
        ours.vision.pos_embed,
        ours.action_in_proj,
        ours.action_out_proj,
        ours.time_mlp_in,
        ours.time_mlp_out,
    ):
        m.float()
    for name, m in ours.named_modules():
        if name.endswith(("input_norm", "post_attn_norm", "final_norm")) and not name.startswith("vision"):
            m.float()
    print(f"LoongForge pi0.5: {sum(p.numel() for p in ours.parameters()) / 1e9:.3f}B parameters", flush=True)
    obs = Observation(images.bfloat16(), image_masks, tokens, token_masks)
    obs1 = Observation(one(obs.images), one(image_masks), one(tokens), one(token_masks))
    ours.train()
    if args.recompute:
        from loongforge.core.stacks.torch_native import recompute_block

        for block in ours.blocks():
            recompute_block(block)
    loss_fn = lambda: ours.flow_matching_loss(obs, actions)  # noqa: E731
    if not args.compiled_only:
        step = trainer_step_fn(loss_fn, ours.parameters(), action_dim, ops)
        rows.append(measure("LoongForge", step, lambda: ours.sample_actions(obs1), b, args))
        if args.profile and dev == "cuda":
            print_profile("our", step)
        if dev == "cuda":
            ours.eval()
            sampler, noise = ours.graphed_sampler(), torch.randn(1, chunk, 32, device=dev)
            rows.append(chunk_latency("LoongForge, CUDA graph", lambda: sampler(obs1, noise), args))
            ours.train()
    if args.compile:
        try:
            compiled_loss = torch.compile(ours.flow_matching_loss)
            compiled_velocity = torch.compile(ours.cached_velocity)
            ours.cached_velocity = compiled_velocity
            step = trainer_step_fn(lambda: compiled_loss(obs, actions), ours.parameters(), action_dim, ops)
            infer = None if args.compiled_step_only else lambda: ours.sample_actions(obs1)
            rows.append(measure("LoongForge + compile", step, infer, b, args))
        except Exception as e:  # report and keep the eager rows
            print(f"compile failed: {type(e).__name__}: {e}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--site", required=True)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--latency-iters", type=int, default=10)
    ap.add_argument("--compile", action="store_true", help="also time LoongForge with torch.compile on the loss and the velocity")
    ap.add_argument("--compiled-only", action="store_true", help="with --compile: only the compiled rows (both sides)")
    ap.add_argument(
        "--compiled-step-only",
        action="store_true",
        help="with --compile: the compiled rows time the training step only (compiling LeRobot's 10-step sampler is the slow part)",
    )
    ap.add_argument("--recompute", action="store_true", help="activation recompute on both sides (each side's own)")
    ap.add_argument("--skip-lerobot", action="store_true")
    ap.add_argument("--profile", action="store_true", help="print the top kernels of each side's eager step")
    ap.add_argument("--tiny", action="store_true", help="the oracle's tiny shapes (a dry run of this script, on the CPU too)")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "oracles"))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import pi_vs_lerobot as harness

    sys.path.insert(0, args.site)
    sys.meta_path.insert(0, harness._StubFinder())
    harness.patch_transformers()
    torch.backends.cuda.matmul.allow_tf32 = True
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    b, cams, size, length, chunk, action_dim = args.batch, 2, 224, 200, 50, 7
    if args.tiny:
        b, size, length, chunk = 2, 56, 12, 8
    g = torch.Generator(device=dev).manual_seed(0)
    images = torch.rand(b, cams, 3, size, size, device=dev, generator=g) * 2 - 1
    image_masks = torch.ones(b, cams, dtype=torch.bool, device=dev)
    tokens = torch.randint(0, 257152, (b, length), device=dev, generator=g)
    token_masks = torch.ones(b, length, dtype=torch.bool, device=dev)
    token_masks[:, (3 * length) // 4 :] = False  # prompts padded to 200 as LeRobot's tokenizer step pads them
    actions = torch.randn(b, chunk, 32, device=dev, generator=g)
    one = lambda x: x[:1]  # noqa: E731
    rows = []
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}", flush=True)

    # ---- LoongForge (in a function: its model is freed before LeRobot's is built)
    run_ours(args, rows, dev, b, size, chunk, action_dim, images, image_masks, tokens, token_masks, actions, one)
    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()

    # ---- LeRobot
    if not args.skip_lerobot:
        from lerobot.configs.types import FeatureType, PolicyFeature
        from lerobot.policies.pi05 import modeling_pi05
        from lerobot.policies.pi05.configuration_pi05 import PI05Config

        if args.tiny:
            harness.tiny_shapes(modeling_pi05, 2, 32)

        features = {f"observation.images.cam{c}": PolicyFeature(FeatureType.VISUAL, (3, size, size)) for c in range(cams)}
        features["observation.state"] = PolicyFeature(FeatureType.STATE, (8,))
        lr_cfg = PI05Config(
            input_features=features,
            output_features={"action": PolicyFeature(FeatureType.ACTION, (action_dim,))},
            device=dev,
            dtype="bfloat16",
            chunk_size=chunk,
            n_action_steps=chunk,
            image_resolution=(size, size),
        )
        with torch.device(dev):
            lr = modeling_pi05.PI05Policy(lr_cfg)
        print(f"LeRobot PI05Policy: {sum(p.numel() for p in lr.parameters()) / 1e9:.3f}B parameters", flush=True)
        if args.recompute:
            lr.model.gradient_checkpointing_enable()
        lr.train()
        imgs, masks = list(images.unbind(1)), list(image_masks.unbind(1))
        imgs1, masks1 = [one(x) for x in imgs], [one(x) for x in masks]
        loss_fn = lambda: lr.model.forward(imgs, masks, tokens, token_masks, actions)  # noqa: E731
        infer = lambda: lr.model.sample_actions(imgs1, masks1, one(tokens), one(token_masks))  # noqa: E731
        if not args.compiled_only:
            step = train_step_fn(loss_fn, lr.parameters(), action_dim)
            rows.append(measure("LeRobot 0.4.4", step, infer, b, args))
            if args.profile and dev == "cuda":
                print_profile("LeRobot's", step)
            if dev == "cuda":
                # LeRobot's own sample_actions, captured and replayed by the same GraphedCall as ours
                from loongforge.core.accelerator.cuda_graph import GraphedCall

                lr.eval()
                graphed = GraphedCall(
                    lambda *t: lr.model.sample_actions(list(t[:cams]), list(t[cams : 2 * cams]), t[-3], t[-2], noise=t[-1])
                )
                noise = torch.randn(1, chunk, 32, device=dev)
                try:
                    rows.append(
                        chunk_latency(
                            "LeRobot 0.4.4, CUDA graph", lambda: graphed(*imgs1, *masks1, one(tokens), one(token_masks), noise), args
                        )
                    )
                except Exception as e:  # a host sync in its sampler fails the capture: report it
                    print(f"LeRobot CUDA graph failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                lr.train()
        if args.compile:
            # what LeRobot's compile_model does (its forward and sample_actions through torch.compile),
            # in torch.compile's default mode as LoongForge's row uses
            try:
                lr.model.forward = torch.compile(lr.model.forward)
                lr.model.sample_actions = torch.compile(lr.model.sample_actions)
                step = train_step_fn(loss_fn, lr.parameters(), action_dim)
                rows.append(measure("LeRobot 0.4.4 + compile", step, None if args.compiled_step_only else infer, b, args))
            except Exception as e:
                print(f"LeRobot compile failed: {type(e).__name__}: {e}", flush=True)

    print(f"\n{'':24s} {'step ms':>9s} {'samples/s':>10s} {'peak GiB':>9s} {'chunk ms':>9s}")
    for r in rows:
        print(f"{r['name']:24s} {r['step_ms']:9.1f} {r['samples_per_s']:10.2f} {r['peak_gib']:9.1f} {r['chunk_latency_ms']:9.1f}")
    by_name = {r["name"]: r for r in rows}
    pairs = (("LoongForge", "LeRobot 0.4.4"), ("LoongForge + compile", "LeRobot 0.4.4 + compile"))
    for ours_name, theirs_name in pairs:
        r, base = by_name.get(ours_name), by_name.get(theirs_name)
        if r and base:
            print(
                f"{ours_name} / {theirs_name}: throughput {r['samples_per_s'] / base['samples_per_s']:.2f}x, "
                f"memory {r['peak_gib'] / base['peak_gib']:.2f}x, chunk latency {base['chunk_latency_ms'] / r['chunk_latency_ms']:.2f}x faster"
            )
    graph_rows = ("LoongForge, CUDA graph", "LeRobot 0.4.4, CUDA graph", "LeRobot 0.4.4")
    r = by_name.get(graph_rows[0])
    for theirs in graph_rows[1:]:
        if r and theirs in by_name:
            print(f"{graph_rows[0]} / {theirs}: chunk latency {by_name[theirs]['chunk_latency_ms'] / r['chunk_latency_ms']:.2f}x faster")
    return 0


if __name__ == "__main__":
    sys.exit(main())
