"""MoE training throughput on one GPU: LoongForge's Qwen3-MoE (megatron-core MoELayer with our
router, op-table dispatcher and grouped-GEMM experts) against megatron-core's own MoE GPT and HF
transformers' Qwen3MoeForCausalLM (eager and torch.compile), same shape, same tokens, same process.

    python tools/benchmarks/moe_throughput.py                      # Qwen3-30B-A3B layer shape, 8 layers, seq 4096
    python tools/benchmarks/moe_throughput.py --layers 2 --steps 3 --warmup 1   # a quick smoke run

Shape (Qwen3-30B-A3B's layers): hidden 2048, 32 query heads / 4 KV heads of 128, q/k norm, 128
experts of FFN 768, top-8 with renormalized probabilities, vocab 151936, every layer MoE; seq 4096,
micro-batch 1. Each setup trains `--warmup` steps untimed, then `--steps` timed steps (CUDA events
around the loop): ms/step, tokens/s, TFLOP/s, MFU against 989 TFLOP/s dense bf16, peak memory.
FLOPs/token = 6 * active params (attention, router, the top-k experts, embeddings) + 12 * layers *
heads * head_dim * seq (the dense benchmark's formula on active parameters; no recompute counted).
No auxiliary loss on any side (HF's needs output_router_logits; megatron's and ours coefficient 0).

Setups (pure bf16 everywhere: bf16 parameters, gradients and AdamW state, fused AdamW or our
op-table AdamW, clipping at 1.0):
- `loongforge trainer (pure bf16)`: `Trainer.train_step` of the LLM task on our Qwen3-MoE.
- `loongforge trainer`: the same at our GPU default (bf16 over fp32 master weights); not the
  baselines' precision (printed for reference; may not fit on an 80 GB card).
- `hf eager` / `hf compile`: Qwen3MoeForCausalLM (sdpa), `.bfloat16()`, fused AdamW.
- `megatron moe`: megatron-core's GPTModel with `get_gpt_layer_local_spec(num_experts=...)`: its
  unfused attention and, without transformer-engine or the grouped_gemm package, its
  `SequentialMLP` experts (the expert implementation megatron-core has on this image), all-to-all
  dispatcher, the TE-less router fix.

Then a profile of our pure-bf16 step gives the share of GPU time in the expert GEMMs, in token
dispatch (routing top-k, the permute sort and kernels) and in attention.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from llm_throughput import hf_train_step, loongforge_step, megatron_train_step, profile_shares, timed  # noqa: E402


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--expert-ffn", type=int, default=768)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--setups", default="loongforge trainer (pure bf16),hf eager,megatron moe,hf compile,loongforge trainer")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--json", default=None)
    return p.parse_args()


def model_config(a):
    from loongforge.core.foundation.families import QWEN3_MOE
    from loongforge.core.foundation.spec import ModelConfig

    return QWEN3_MOE.resolve(
        ModelConfig(
            family="qwen3_moe",
            num_layers=a.layers,
            hidden_size=a.hidden,
            num_attention_heads=a.heads,
            num_query_groups=a.kv_heads,
            head_dim=a.head_dim,
            ffn_hidden_size=6144,  # (no dense layer in this shape)
            vocab_size=a.vocab,
            max_position_embeddings=max(a.seq, 4096),
            rope_theta=1e6,
            norm_eps=1e-6,
            num_experts=a.experts,
            moe_top_k=a.top_k,
            moe_ffn_hidden_size=a.expert_ffn,
            moe_norm_topk_prob=True,
        )
    )


def hf_step(mcfg, tokens, compile_: bool):
    """HF's Qwen3MoeForCausalLM of the same shape, pure bf16 (`llm_throughput.hf_train_step`)."""
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        hidden_size=mcfg.hidden_size,
        intermediate_size=mcfg.ffn_hidden_size,
        num_hidden_layers=mcfg.num_layers,
        num_attention_heads=mcfg.num_attention_heads,
        num_key_value_heads=mcfg.num_query_groups,
        head_dim=mcfg.kv_channels,
        vocab_size=mcfg.vocab_size,
        max_position_embeddings=mcfg.max_position_embeddings,
        rope_theta=mcfg.rope_theta,
        rms_norm_eps=mcfg.norm_eps,
        num_experts=mcfg.num_experts,
        num_experts_per_tok=mcfg.moe_top_k,
        moe_intermediate_size=mcfg.moe_ffn_hidden_size,
        norm_topk_prob=mcfg.moe_norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        output_router_logits=False,
        attn_implementation="sdpa",
        use_cache=False,
    )
    step, keep = hf_train_step(cfg, tokens, compile_)
    print(f"  hf experts implementation: {getattr(keep[0].config, '_experts_implementation', None)!r}", flush=True)
    return step, keep


def megatron_moe_step(mcfg, tokens):
    from loongforge.core.accelerator import get_accelerator
    from loongforge.core.foundation.moe import ensure_router_without_te
    from loongforge.core.foundation.spec import transformer_config
    from loongforge.core.parallel import init_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    acc = get_accelerator("cuda")
    init_parallel(1, 1, acc.backend, acc.device_type)
    ensure_router_without_te()
    acc.manual_seed(0)
    config = transformer_config(mcfg, 1, 1, torch.bfloat16, recompute=False)
    config = dataclasses.replace(config, moe_token_dispatcher_type="alltoall", calculate_per_token_loss=False, bf16=True)
    spec = get_gpt_layer_local_spec(num_experts=mcfg.num_experts, moe_grouped_gemm=False, qk_layernorm=True, normalization="RMSNorm")
    model = (
        GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=mcfg.vocab_size,
            max_sequence_length=mcfg.max_position_embeddings,
            position_embedding_type="rope",
            rotary_base=int(mcfg.rope_theta),
        )
        .cuda()
        .bfloat16()
    )
    return megatron_train_step(model, tokens)


CATEGORIES = (
    ("expert GEMM", ("grouped", "Grouped", "GroupProblemShape")),  # torch grouped_mm: CUTLASS grouped kernels
    ("dispatch (top-k, sort, permute)", ("_scatter", "_combine", "_scatter_dot", "adixSort", "topk", "TopK", "sbtopk", "searchsorted")),
    ("attention", ("flash", "fmha", "attention", "Attention")),
    ("AdamW", ("_adamw_tensor", "FusedAdam")),
    ("gradient norm", ("LpNorm", "_sum_squares")),
)


def main():
    a = parse()
    logging.getLogger("megatron").setLevel(logging.ERROR)
    mcfg = model_config(a)
    torch.manual_seed(0)
    tokens = torch.randint(0, a.vocab, (a.micro_batch, a.seq), device="cuda")
    tok_per_step = a.micro_batch * a.seq
    fpt = mcfg.flops_per_token(a.seq)
    peak = 989e12
    builders = {
        "loongforge trainer (pure bf16)": lambda: loongforge_step(mcfg, tokens, "pure", True),
        "loongforge trainer": lambda: loongforge_step(mcfg, tokens, "masters", True),
        "hf eager": lambda: hf_step(mcfg, tokens, compile_=False),
        "hf compile": lambda: hf_step(mcfg, tokens, compile_=True),
        "megatron moe": lambda: megatron_moe_step(mcfg, tokens),
    }
    print(
        f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, params {mcfg.num_params() / 1e9:.3f}B "
        f"({mcfg.num_active_params() / 1e9:.3f}B active), {tok_per_step} tokens/step, {fpt / 1e9:.2f} GFLOP/token",
        flush=True,
    )
    names = [s.strip() for s in a.setups.split(",")]
    unknown = [n for n in names if n not in builders]
    if unknown:
        raise SystemExit(f"unknown setups {unknown}; choose from: {', '.join(builders)}")
    results, shares = {}, None
    for name in names:
        t0 = time.time()
        try:
            step, keep = builders[name]()
            ms, mem = timed(step, a.warmup, a.steps)
            if name == "loongforge trainer (pure bf16)" and not a.no_profile:
                shares = profile_shares(step, CATEGORIES, top=40)
            del step, keep
        except torch.OutOfMemoryError:
            print(f"{name}: out of memory", flush=True)
            results[name] = None
            gc.collect()
            torch.cuda.empty_cache()
            continue
        except Exception as e:  # report the setup as failed and go on with the others
            print(f"{name}: failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
            results[name] = None
            gc.collect()
            torch.cuda.empty_cache()
            continue
        tps = tok_per_step / (ms / 1e3)
        results[name] = {"ms_per_step": ms, "tokens_per_s": tps, "tflops": tps * fpt / 1e12, "mfu": tps * fpt / peak, "peak_gib": mem}
        print(
            f"{name}: {ms:.1f} ms/step, {tps:,.0f} tok/s, {100 * tps * fpt / peak:.1f}% MFU, peak {mem:.1f} GiB ({time.time() - t0:.0f}s)",
            flush=True,
        )
        gc.collect()
        torch.cuda.empty_cache()
    print("\n| setup | ms/step | tokens/s | TFLOP/s | MFU (of 989) | peak GiB |")
    print("| --- | --- | --- | --- | --- | --- |")
    for n, r in results.items():
        if r is None:
            print(f"| {n} | out of memory or failed (see above) | | | | |")
            continue
        print(
            f"| {n} | {r['ms_per_step']:.1f} | {r['tokens_per_s']:,.0f} | {r['tflops']:.0f} | {100 * r['mfu']:.1f}% | {r['peak_gib']:.1f} |"
        )
    ours = results.get("loongforge trainer (pure bf16)")
    if ours:
        for b in ("hf eager", "hf compile", "megatron moe"):
            if results.get(b):
                print(f"ratio loongforge trainer (pure bf16) / {b}: {ours['tokens_per_s'] / results[b]['tokens_per_s']:.2f}x tokens/s")
    if shares:
        print("shares of our step's GPU time: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in shares.items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": vars(a), "results": results, "shares": shares, "gpu": torch.cuda.get_device_name()}, f, indent=1)


if __name__ == "__main__":
    main()
