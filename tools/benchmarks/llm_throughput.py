"""LLM training throughput on one GPU: LoongForge's megatron-core model against HF transformers
(eager and torch.compile), same config, same tokens, same process.

    python tools/benchmarks/llm_throughput.py                 # the 1.3B Llama-style config
    python tools/benchmarks/llm_throughput.py --layers 2 --steps 3 --warmup 1   # a quick smoke run

Each setup trains `--warmup` steps untimed, then `--steps` timed steps (CUDA events around the
whole loop), and reports ms/step, tokens/s, TFLOP/s, MFU against the GPU's dense bf16 peak and
peak memory. FLOPs per token = 6 * params + 12 * layers * hidden * seq (no recompute counted).

Setups (every `loongforge ...` row times `Trainer.train_step` itself: loss normalization over the
global batch, gradient finalization, norm, LR update, clipped AdamW through op `adamw`, NaN/Inf
guard; one fixed micro-batch per step, so no data loading):
- `loongforge trainer`: the megatron stack as `loongforge-llm train` runs it on a GPU: bf16
  parameters with fp32 master weights (fp32 gradient accumulation, fp32 AdamW, copy back), bf16
  autocast, the GPU op table (Triton RMSNorm, RoPE, SwiGLU, fused linear + cross-entropy when
  loongforge-kernels is installed). Compare with `hf compile fp32 params + autocast` (fp32 masters
  on both sides).
- `loongforge trainer (pure bf16)`: the same with `train.master_weights=false`: bf16 parameters,
  gradients and AdamW state, the precision of `hf eager`, `hf compile` and `megatron local spec`.
- `... + recompute`: full activation recompute (`train.recompute=true`), one layer at a time.
- `loongforge trainer (reference ops)`: the same step with core's plain-torch op references.
- `loongforge fp32 params + autocast`: fp32 parameters under bf16 autocast, GPU op table.
- `loongforge torch stack (fsdp)` / `(fsdp) pure bf16`: `parallel.stack=torch`: the HF
  LlamaForCausalLM as-is under FSDP2 (`fully_shard` per block; masters: fp32 parameters, bf16
  compute through FSDP's mixed-precision policy), the loss through our op table; `+ compile`:
  `parallel.compile=true` (`torch.compile` of every decoder layer), the setting to compare with
  `hf compile`.
- `loongforge-llm train (CLI)` / `(CLI) pure bf16`: the real command, `python -m loongforge.llm.cli
  train llama_1p3b` with this shape in a subprocess (its data loader and logging included);
  2 x `--steps` steps logged every `--steps`: ms/step is the trainer's mean over the second
  window, peak memory its logged peak.
- `hf eager` / `hf compile`: LlamaForCausalLM (sdpa), bf16 parameters, fused AdamW.
- `hf compile fp32 params + autocast`: fp32 parameters, bf16 autocast, compiled (the HF
  Trainer's bf16 setting).
- `megatron local spec`: megatron-core's own GPTModel with `get_gpt_layer_local_spec` (no
  transformer-engine: its unfused DotProductAttention), bf16 parameters, same step.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import time
from pathlib import Path

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

    return ModelConfig(
        family="llama",
        num_layers=a.layers,
        hidden_size=a.hidden,
        num_attention_heads=a.heads,
        num_query_groups=a.kv_heads or a.heads,
        ffn_hidden_size=a.ffn,
        vocab_size=a.vocab,
        max_position_embeddings=max_positions,
    )


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--hf-checkpointing", action="store_true", help="HF setups use gradient checkpointing (ours: the '+ recompute' setups)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--setups",
        default="loongforge trainer,loongforge trainer (pure bf16),loongforge trainer (reference ops),loongforge fp32 params + autocast,"
        "hf eager,hf compile,megatron local spec",
    )
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


def profile_shares(step, categories, steps: int = 3, top: int = 15, ops: tuple[str, ...] = ()) -> dict:
    """Shares of GPU time by kernel category over `steps` steps of `step` (after one warm step):
    `categories` is ((name, (substring of a kernel name, ...)), ...); a kernel counts in its first
    match. Prints the top kernels, and with `ops` (aten op names such as "aten::copy_") the GPU
    time of those ops by input shapes: which tensors the copies and concatenations move."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    activities = [ProfilerActivity.CUDA, ProfilerActivity.CPU] if ops else [ProfilerActivity.CUDA]
    stacks = dict(record_shapes=True, with_stack=True, experimental_config=torch._C._profiler._ExperimentalConfig(verbose=True))
    with profile(activities=activities, **(stacks if ops else {})) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    if ops:
        averages = prof.key_averages(group_by_input_shape=True, group_by_stack_n=4)
        rows = [ev for ev in averages if ev.key in ops and ev.device_time_total]
        print(f"GPU time of {', '.join(ops)} by input shapes and caller (per step; no caller: in backward):")
        for ev in sorted(rows, key=lambda ev: -ev.device_time_total)[:top]:
            where = " <- ".join(f.split("/")[-1] for f in ev.stack if not f.startswith("<built-in"))[:160] or "-"
            print(
                f"  {ev.device_time_total / steps / 1e3:6.2f} ms  {ev.count // steps:4d} calls  {ev.key}  {str(ev.input_shapes)[:110]}  {where}"
            )
    kernels = {}
    annotations = {ev.name for ev in prof.events() if ev.is_user_annotation}  # ranges such as Optimizer.step, not kernels
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t and ev.device_type.name == "CUDA" and ev.key not in annotations:
            kernels[ev.key] = kernels.get(ev.key, 0) + t
    total = sum(kernels.values())
    shares = {name: 0.0 for name, _ in categories}
    for k, t in kernels.items():
        for name, needles in categories:
            if any(n in k for n in needles):
                shares[name] += t
                break
    print(f"profile: {total / steps / 1e3:.1f} ms GPU time per step; top kernels:")
    for k, t in sorted(kernels.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {100 * t / total:5.1f}%  {t / steps / 1e3:6.2f} ms  {k[:180]}")
    return {name: t / total for name, t in shares.items()}


def loongforge_trainer(
    mcfg, rows: int, seq: int, precision: str, kernels: bool, recompute: bool = False, stack: str = "megatron", compile_: bool = False
):
    """A set-up `Trainer` of the LLM task for micro-batches of `rows` x `seq` tokens, one per step.
    precision: "masters" (bf16 params, fp32 masters: the GPU default), "pure" (all bf16) or
    "fp32" (fp32 params under bf16 autocast). stack: "megatron" (our megatron-core model) or
    "torch" (the HF model as-is on FSDP2 with our op table's loss)."""
    import tempfile

    from loongforge.core.accelerator import get_accelerator
    from loongforge.core.config import CheckpointConfig, ParallelConfig, TrainConfig
    from loongforge.core.ops import OpTable
    from loongforge.core.registry import registry
    from loongforge.core.stacks.build import build_stack
    from loongforge.core.train.trainer import Trainer
    from loongforge.llm.config import PretrainConfig
    from loongforge.llm.pretrain import CausalLMTask, RunData

    acc = get_accelerator("cuda")
    mcfg = registry().get("family", mcfg.family).resolve(mcfg)
    b, s = rows, seq
    train = TrainConfig(
        micro_batch_size=b,
        global_batch_size=b,
        train_iters=1 << 30,
        lr=1e-4,
        lr_warmup_iters=0,
        weight_decay=0.1,
        params_dtype="float32" if precision == "fp32" else "bfloat16",
        master_weights=precision != "pure",
        recompute=recompute,
    )
    par = ParallelConfig(stack=stack, data_parallel_mode="fsdp", compile=compile_)
    cfg = PretrainConfig(model=mcfg, parallel=par, train=train, checkpoint=CheckpointConfig(run_dir=tempfile.mkdtemp(), export_hf=False))
    cfg.data.seq_length = s
    params_dtype = {"fp32": torch.float32}.get(precision, torch.bfloat16)
    stack_obj, ctx = build_stack(par, train, acc, params_dtype)
    ops = OpTable.build(None, registry(), "cuda") if kernels else OpTable()
    data = RunData(lambda start: iter(()), b * s, b)  # the caller hands train_step its micro-batches
    task = CausalLMTask(cfg, mcfg, None, stack_obj, ctx, ops, data, acc.device(), Path(cfg.checkpoint.run_dir))
    trainer = Trainer(train, cfg.checkpoint, stack_obj, acc, task, {}, "benchmark", ops)
    trainer.setup()
    return trainer


def loongforge_step(mcfg, tokens, precision: str, kernels: bool, recompute: bool = False, stack: str = "megatron", compile_: bool = False):
    """`Trainer.train_step` itself on a fixed micro-batch: the trainer's loss normalization,
    gradient finalization, norm, LR update, clipped AdamW (op `adamw`) and NaN/Inf guard."""
    trainer = loongforge_trainer(mcfg, tokens.shape[0], tokens.shape[1], precision, kernels, recompute, stack, compile_)
    mb = {"tokens": tokens, "labels": tokens.roll(-1, 1), "loss_weights": torch.ones(tokens.shape, device=tokens.device)}

    def step():
        trainer.train_step([mb])

    return step, trainer


def cli_timed(a, precision: str, warmup: int, steps: int) -> tuple[float, float]:
    """The training command itself on this shape: (mean ms/step of its last `steps` steps, peak GiB); the
    first `steps` steps warm up (`warmup` is not used: the log interval is the window)."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "train",
            "llama_1p3b",
            f"model.num_layers={a.layers}",
            f"model.hidden_size={a.hidden}",
            f"model.num_attention_heads={a.heads}",
            f"model.num_query_groups={a.kv_heads or a.heads}",
            f"model.ffn_hidden_size={a.ffn}",
            f"model.vocab_size={a.vocab}",
            f"model.max_position_embeddings={a.seq}",
            f"data.seq_length={a.seq}",
            f"train.micro_batch_size={a.micro_batch}",
            f"train.global_batch_size={a.micro_batch}",
            f"train.train_iters={2 * steps}",
            f"train.log_interval={steps}",
            "train.eval_interval=0",
            "train.save_interval=0",
            f"train.master_weights={'true' if precision == 'masters' else 'false'}",
            "checkpoint.export_hf=false",
            f"checkpoint.run_dir={tmp}/run",
        ]
        r = subprocess.run([sys.executable, "-m", "loongforge.llm.cli", *args], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"loongforge-llm train failed ({r.returncode}): {r.stderr[-2000:]}")
        rows = [json.loads(line) for line in open(f"{tmp}/run/metrics.jsonl")]
    last = max(rows, key=lambda r: r["step"])  # the mean over the last `steps` steps (the first `steps` warm up)
    return 1e3 * last["step_time_s"], last["mem_peak_gib"]


def megatron_local_step(mcfg, tokens):
    from loongforge.core.accelerator import get_accelerator
    from loongforge.core.foundation.families import LLAMA
    from loongforge.core.foundation.spec import transformer_config
    from loongforge.core.parallel import init_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    acc = get_accelerator("cuda")
    init_parallel(1, 1, acc.backend, acc.device_type)
    acc.manual_seed(0)
    config = transformer_config(LLAMA.resolve(mcfg), 1, 1, torch.bfloat16, recompute=False)
    config.bf16 = True
    model = (
        GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
            vocab_size=mcfg.vocab_size,
            max_sequence_length=mcfg.max_position_embeddings,
            position_embedding_type="rope",
        )
        .cuda()
        .bfloat16()
    )
    return megatron_train_step(model, tokens)


def megatron_train_step(model, tokens):
    """A step of a megatron-core GPTModel as Megatron users train it here: the mean token loss,
    fused AdamW, clipping at 1.0."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    labels = tokens.roll(-1, 1)

    def step():
        for p in model.parameters():
            p.grad = None
        model(tokens, None, None, labels=labels).float().mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()

    return step, (model, opt)


def hf_step(mcfg, tokens, compile_: bool, checkpointing: bool = False, fp32_params: bool = False):
    """HF's LlamaForCausalLM trained as HF users do (see `hf_train_step`)."""
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=mcfg.hidden_size,
        intermediate_size=mcfg.ffn_hidden_size,
        num_hidden_layers=mcfg.num_layers,
        num_attention_heads=mcfg.num_attention_heads,
        num_key_value_heads=mcfg.num_query_groups,
        vocab_size=mcfg.vocab_size,
        max_position_embeddings=mcfg.max_position_embeddings,
        attn_implementation="sdpa",
        use_cache=False,
    )
    return hf_train_step(cfg, tokens, compile_, checkpointing, fp32_params)


def hf_train_step(cfg, tokens, compile_: bool, checkpointing: bool = False, fp32_params: bool = False):
    """A step of the HF causal LM of config `cfg` trained as HF users do: pure bf16
    (`.bfloat16()`), or with `fp32_params` fp32 parameters under bf16 autocast (what the HF
    Trainer's bf16 flag does); fused AdamW, clipping at 1.0, optionally `torch.compile`."""
    import transformers

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg).train()
    if not fp32_params:
        model = model.bfloat16()
    if checkpointing:
        model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    fwd = torch.compile(model) if compile_ else model
    labels = tokens.clone()

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", torch.bfloat16, enabled=fp32_params):
            loss = fwd(input_ids=tokens, labels=labels).loss
        loss.backward()
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
        "hf compile fp32 params + autocast": lambda: hf_step(
            mcfg, tokens, compile_=True, checkpointing=a.hf_checkpointing, fp32_params=True
        ),
        "loongforge torch stack (fsdp)": lambda: loongforge_step(mcfg, tokens, "masters", True, stack="torch"),
        "loongforge torch stack (fsdp) pure bf16": lambda: loongforge_step(mcfg, tokens, "pure", True, stack="torch"),
        "loongforge torch stack (fsdp) + compile": lambda: loongforge_step(mcfg, tokens, "masters", True, stack="torch", compile_=True),
        "loongforge torch stack (fsdp) pure bf16 + compile": lambda: loongforge_step(
            mcfg, tokens, "pure", True, stack="torch", compile_=True
        ),
        "megatron local spec": lambda: megatron_local_step(mcfg, tokens),
    }
    cli_setups = {"loongforge-llm train (CLI)": "masters", "loongforge-llm train (CLI) pure bf16": "pure"}
    print(
        f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, params {mcfg.num_params() / 1e9:.3f}B, "
        f"{tok_per_step} tokens/step, {fpt / 1e9:.2f} GFLOP/token",
        flush=True,
    )
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
        print(
            f"{name}: {ms:.1f} ms/step, {tps:,.0f} tok/s, {tps * fpt / 1e12:.0f} TFLOP/s, peak {mem:.1f} GiB ({time.time() - t0:.0f}s)",
            flush=True,
        )
        gc.collect()
        torch.cuda.empty_cache()
    print("\n| setup | ms/step | tokens/s | TFLOP/s | MFU (of 989) | peak GiB |")
    print("| --- | --- | --- | --- | --- | --- |")
    for n, r in results.items():
        print(
            f"| {n} | {r['ms_per_step']:.1f} | {r['tokens_per_s']:,.0f} | {r['tflops']:.0f} | {100 * r['mfu']:.1f}% | {r['peak_gib']:.1f} |"
        )
    base = {k: v for k, v in results.items() if not k.startswith("loongforge")}
    for ours in [k for k in results if k.startswith("loongforge")]:
        for b, r in base.items():
            print(f"ratio {ours} / {b}: {results[ours]['tokens_per_s'] / r['tokens_per_s']:.2f}x tokens/s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": vars(a), "results": results, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
