"""LLM training throughput on one GPU: LoongForge's megatron-core model against HF transformers
(eager and torch.compile), same config, same tokens, same process.

    python tools/benchmarks/llm_throughput.py                 # the 1.3B Llama-style config
    python tools/benchmarks/llm_throughput.py --layers 2 --steps 3 --warmup 1   # a quick smoke run

Each setup trains `--warmup` steps untimed, then `--steps` timed steps (CUDA events around the
whole loop), and reports ms/step, tokens/s, TFLOP/s, MFU against the GPU's dense bf16 peak and
peak memory. FLOPs per token = 6 * params + 12 * layers * hidden * seq (no recompute counted).

Setups:
- `loongforge trainer`: the step `loongforge-llm train` runs on a GPU: bf16 parameters with fp32
  master weights (fp32 gradient accumulation, fp32 AdamW, copy back), bf16 autocast, the GPU op
  table (Triton RMSNorm, RoPE, SwiGLU, fused linear + cross-entropy when loongforge-kernels is
  installed), core's forward_backward, the trainer's gradient norm and clipped AdamW step (op `adamw`).
- `loongforge trainer (pure bf16)`: the same with `train.master_weights=false`: bf16 parameters,
  gradients and AdamW state, the precision of the HF and megatron baselines below.
- `... + recompute`: full activation recompute (`train.recompute=true`), one layer at a time.
- `loongforge trainer (reference ops)`: the same step with core's plain-torch op references.
- `loongforge fp32 params + autocast`: the previous default (fp32 parameters, bf16 autocast),
  GPU op table.
- `loongforge-llm train (CLI)` / `(CLI) pure bf16`: the real command, `python -m loongforge.llm.cli
  train llama_1p3b` with this shape in a subprocess (its data loader, NaN/Inf guard and per-step
  logging with their host syncs included); ms/step is the median of the trainer's own step times
  over the last `--steps` steps, peak memory its logged peak.
- `hf eager` / `hf compile`: LlamaForCausalLM (sdpa), bf16 parameters, fused AdamW.
- `megatron local spec`: megatron-core's own GPTModel with `get_gpt_layer_local_spec` (no
  transformer-engine: its unfused DotProductAttention), bf16 parameters, same step.
"""

from __future__ import annotations

import argparse
import logging
import gc
import json
import time

import torch


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model shape every benchmark script takes (default: the 1.3B Llama-style config)."""
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads (MHA)")
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)


def model_config(a, max_positions: int):
    from loongforge.core.foundation.spec import ModelConfig

    return ModelConfig(family="llama", num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
                       num_query_groups=a.kv_heads or a.heads, ffn_hidden_size=a.ffn, vocab_size=a.vocab, max_position_embeddings=max_positions)


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--hf-checkpointing", action="store_true", help="HF setups use gradient checkpointing (ours: the '+ recompute' setups)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--setups", default="loongforge trainer,loongforge trainer (pure bf16),loongforge trainer (reference ops),loongforge fp32 params + autocast,"
                                       "hf eager,hf compile,megatron local spec")
    p.add_argument("--json", default=None, help="also write the results here")
    return p.parse_args()


def timed(step, warmup: int, steps: int) -> tuple[float, float]:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps, torch.cuda.max_memory_allocated() / 2**30


def loongforge_step(mcfg, tokens, precision: str, kernels: bool, recompute: bool = False):
    """precision: "masters" (bf16 params, fp32 masters: the GPU default), "pure" (all bf16) or
    "fp32" (fp32 params under bf16 autocast)."""
    from loongforge.core.accelerator import get_accelerator
    from loongforge.core.foundation.families import LLAMA
    from loongforge.core.foundation.spec import build_gpt_model
    from loongforge.core.ops import OpTable
    from loongforge.core.parallel import init_parallel
    from loongforge.core.registry import registry
    from loongforge.core.train.pipeline import forward_backward
    from loongforge.core.train.precision import MasterWeights, PureLowPrecision
    from loongforge.core.train.optimizer import TableAdamW
    from loongforge.core.train.trainer import clipped_step, grad_sq_norm

    acc = get_accelerator("cuda")
    ctx = init_parallel(1, 1, acc.backend, acc.device_type)
    acc.manual_seed(0)
    ops = OpTable.build(None, registry(), "cuda") if kernels else OpTable()
    model = build_gpt_model(LLAMA.resolve(mcfg), ctx, ops, recompute=recompute)
    if precision == "pure":  # cast before moving: the fp32 copy never reaches the GPU
        model = model.to(torch.bfloat16)
    model = model.cuda()
    opt = TableAdamW(model.parameters(), update=ops.adamw, lr=1e-4, weight_decay=0.1)
    trained = [p for g in opt.param_groups for p in g["params"]]
    low = {"masters": lambda: MasterWeights(model, torch.bfloat16), "pure": lambda: PureLowPrecision(model, opt, torch.bfloat16),
           "fp32": lambda: None}[precision]()
    mb = {"tokens": tokens, "labels": tokens.roll(-1, 1), "loss_weights": torch.full(tokens.shape, 1.0 / tokens.numel(), device=tokens.device)}
    act = (tokens.shape[1], tokens.shape[0], mcfg.hidden_size)

    def step():
        for p in trained:
            p.grad = None
        loss = forward_backward(model, [mb], ctx, act, torch.float32, tokens.device, acc.autocast)
        clipped_step(opt, grad_sq_norm(trained, tokens.device).sqrt(), 1.0, loss)  # the trainer's guard too, on the device
        if low is not None:
            low.copy_to_model()

    return step, (model, opt, low)


def cli_timed(a, precision: str, warmup: int, steps: int) -> tuple[float, float]:
    """The training command itself on this shape: (median ms/step of its last `steps` steps, peak GiB)."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        args = ["train", "llama_1p3b", f"model.num_layers={a.layers}", f"model.hidden_size={a.hidden}", f"model.num_attention_heads={a.heads}",
                f"model.num_query_groups={a.kv_heads or a.heads}", f"model.ffn_hidden_size={a.ffn}", f"model.vocab_size={a.vocab}",
                f"model.max_position_embeddings={a.seq}", f"data.seq_length={a.seq}", f"train.micro_batch_size={a.micro_batch}",
                f"train.global_batch_size={a.micro_batch}", f"train.train_iters={warmup + steps}", "train.log_interval=1",
                "train.eval_interval=0", "train.save_interval=0", f"train.master_weights={'true' if precision == 'masters' else 'false'}",
                "checkpoint.export_hf=false", f"checkpoint.run_dir={tmp}/run"]
        r = subprocess.run([sys.executable, "-m", "loongforge.llm.cli", *args], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"loongforge-llm train failed ({r.returncode}): {r.stderr[-2000:]}")
        rows = [json.loads(line) for line in open(f"{tmp}/run/metrics.jsonl")]
    last = sorted((r for r in rows if r["step"] > warmup), key=lambda r: r["step"])[-steps:]
    times = sorted(r["step_time_s"] for r in last)
    return 1e3 * times[len(times) // 2], max(r["mem_peak_gib"] for r in last)


def megatron_local_step(mcfg, tokens):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from loongforge.core.accelerator import get_accelerator
    from loongforge.core.foundation.families import LLAMA
    from loongforge.core.foundation.spec import transformer_config
    from loongforge.core.parallel import init_parallel

    acc = get_accelerator("cuda")
    init_parallel(1, 1, acc.backend, acc.device_type)
    acc.manual_seed(0)
    config = transformer_config(LLAMA.resolve(mcfg), 1, 1, torch.bfloat16, recompute=False)
    config.bf16 = True
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=mcfg.vocab_size,
                     max_sequence_length=mcfg.max_position_embeddings, position_embedding_type="rope").cuda().bfloat16()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    labels = tokens.roll(-1, 1)

    def step():
        for p in model.parameters():
            p.grad = None
        model(tokens, None, None, labels=labels).float().mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()

    return step, (model, opt)


def hf_step(mcfg, tokens, compile_: bool, checkpointing: bool = False):
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=mcfg.hidden_size, intermediate_size=mcfg.ffn_hidden_size, num_hidden_layers=mcfg.num_layers,
        num_attention_heads=mcfg.num_attention_heads, num_key_value_heads=mcfg.num_query_groups, vocab_size=mcfg.vocab_size,
        max_position_embeddings=mcfg.max_position_embeddings, attn_implementation="sdpa", use_cache=False,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(cfg).bfloat16().train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    fwd = torch.compile(model) if compile_ else model
    labels = tokens.clone()

    def step():
        opt.zero_grad(set_to_none=True)
        fwd(input_ids=tokens, labels=labels).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()

    return step, (model, opt, fwd)


def main():
    a = parse()
    logging.getLogger("megatron").setLevel(logging.ERROR)  # megatron logs one line per layer about our MLP spec

    mcfg = model_config(a, a.seq)
    torch.manual_seed(0)
    tokens = torch.randint(0, a.vocab, (a.micro_batch, a.seq), device="cuda")
    tok_per_step = a.micro_batch * a.seq
    fpt = mcfg.flops_per_token(a.seq)
    peak = 989e12
    builders = {
        "loongforge trainer": lambda: loongforge_step(mcfg, tokens, "masters", True),
        "loongforge trainer (pure bf16)": lambda: loongforge_step(mcfg, tokens, "pure", True),
        "loongforge trainer (pure bf16) + recompute": lambda: loongforge_step(mcfg, tokens, "pure", True, recompute=True),
        "loongforge trainer (reference ops)": lambda: loongforge_step(mcfg, tokens, "masters", False),
        "loongforge fp32 params + autocast": lambda: loongforge_step(mcfg, tokens, "fp32", True),
        "hf eager": lambda: hf_step(mcfg, tokens, compile_=False, checkpointing=a.hf_checkpointing),
        "hf compile": lambda: hf_step(mcfg, tokens, compile_=True, checkpointing=a.hf_checkpointing),
        "megatron local spec": lambda: megatron_local_step(mcfg, tokens),
    }
    cli_setups = {"loongforge-llm train (CLI)": "masters", "loongforge-llm train (CLI) pure bf16": "pure"}
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, params {mcfg.num_params() / 1e9:.3f}B, "
          f"{tok_per_step} tokens/step, {fpt / 1e9:.2f} GFLOP/token", flush=True)
    results = {}
    names = [s.strip() for s in a.setups.split(",")]
    unknown = [n for n in names if n not in builders and n not in cli_setups]
    if unknown:
        raise SystemExit(f"unknown setups {unknown}; choose from: {', '.join([*builders, *cli_setups])}")
    for name in names:
        t0 = time.time()
        if name in cli_setups:
            ms, mem = cli_timed(a, cli_setups[name], a.warmup, a.steps)
        else:
            step, keep = builders[name]()
            ms, mem = timed(step, a.warmup, a.steps)
            del step, keep
        tps = tok_per_step / (ms / 1e3)
        results[name] = {"ms_per_step": ms, "tokens_per_s": tps, "tflops": tps * fpt / 1e12, "mfu": tps * fpt / peak, "peak_gib": mem}
        print(f"{name}: {ms:.1f} ms/step, {tps:,.0f} tok/s, {tps * fpt / 1e12:.0f} TFLOP/s, peak {mem:.1f} GiB ({time.time() - t0:.0f}s)", flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    print("\n| setup | ms/step | tokens/s | TFLOP/s | MFU (of 989) | peak GiB |")
    print("| --- | --- | --- | --- | --- | --- |")
    for n, r in results.items():
        print(f"| {n} | {r['ms_per_step']:.1f} | {r['tokens_per_s']:,.0f} | {r['tflops']:.0f} | {100 * r['mfu']:.1f}% | {r['peak_gib']:.1f} |")
    base = {k: v for k, v in results.items() if not k.startswith("loongforge")}
    for ours in [k for k in results if k.startswith("loongforge")]:
        for b, r in base.items():
            print(f"ratio {ours} / {b}: {results[ours]['tokens_per_s'] / r['tokens_per_s']:.2f}x tokens/s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": vars(a), "results": results, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
