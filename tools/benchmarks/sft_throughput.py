"""SFT throughput on one GPU: packed against unpacked against HF transformers Trainer-style
training, same model shape, same samples, same process.

    python tools/benchmarks/sft_throughput.py                  # the 1.3B Llama-style config
    python tools/benchmarks/sft_throughput.py --layers 2 --steps 3 --warmup 1

Data: synthetic chat samples with a long-tailed length distribution (lognormal, median 300
tokens, clipped to 32..2048), the first 40% of each sample masked as its prompt. Every setup
takes micro-batches from the same shuffled sample order; "real tokens/s" counts sample tokens
(no padding) processed per second over the timed steps, "efficiency" is real tokens / token
slots of those steps.

Setups:
- `loongforge packed`: core's best-fit-decreasing packing into 8192-token THD rows (micro-batch
  1, positions restart per sample, varlen attention through the op table), the SFT recipe's path.
- `loongforge unpacked`: one sample per row padded to 2048, micro-batch 4 (`data.packing=false`).
- `hf trainer-style`: LlamaForCausalLM (sdpa), micro-batch 4, padded to the longest sample of the
  micro-batch with an attention mask (DataCollatorForSeq2Seq's behaviour), labels -100 on prompt
  and padding, the Trainer's default order (no length grouping).
The LoongForge setups time `Trainer.train_step` (pure bf16, the GPU op table with kernels when
installed, the trainer's clipped AdamW); HF is bf16 too (its default), fused AdamW, grad
clipping 1.0.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from llm_throughput import add_model_args, hf_step, loongforge_trainer, model_config, timed  # noqa: E402


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--pack-len", type=int, default=8192)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--samples", type=int, default=4000)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default=None)
    return p.parse_args()


def make_samples(n, max_len, vocab, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = int(min(max_len, max(32, rng.lognormvariate(5.7, 0.8))))  # median ~300
        tokens = torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        mask = torch.zeros(length)
        mask[int(0.4 * length) :] = 1.0
        out.append({"tokens": tokens, "labels": tokens.roll(-1), "loss_mask": mask})
    return out


def loongforge_setup(mcfg, batches, packed: bool):
    """`Trainer.train_step` of the LLM task (pure bf16, the HF default's precision, GPU op table)
    over `batches` (micro-batch dicts already on the GPU), one per step."""
    mb0 = batches[0]
    trainer = loongforge_trainer(mcfg, mb0["tokens"].shape[0], mb0["tokens"].shape[1], "pure", kernels=True)
    it = iter(batches)

    def step():
        trainer.train_step([next(it)])

    return step, trainer, trainer.ops.names()["varlen_attention"] if packed else None


def main():
    a = parse()
    logging.getLogger("megatron").setLevel(logging.ERROR)  # megatron logs one line per layer about our MLP spec
    from loongforge.core.data import best_fit_decreasing, pack_samples, packing_efficiency

    mcfg = model_config(a, a.pack_len)
    samples = make_samples(a.samples, a.max_len, a.vocab)
    order = list(range(len(samples)))
    random.Random(1).shuffle(order)
    n_steps = a.warmup + a.steps
    results = {}

    # packed: best-fit decreasing over the whole set, packs in a shuffled order
    lengths = [s["tokens"].numel() for s in samples]
    bins = best_fit_decreasing(lengths, a.pack_len)
    random.Random(2).shuffle(bins)
    packed = []
    for b in bins[:n_steps]:
        p = pack_samples(samples, b, a.pack_len, pad_id=0)
        psp = p.packed_seq_params()
        psp.cu_seqlens_q = psp.cu_seqlens_q.cuda()
        psp.cu_seqlens_kv = psp.cu_seqlens_kv.cuda()
        packed.append(
            {
                "tokens": p.tokens.cuda(),
                "labels": p.labels.cuda(),
                "loss_mask": p.loss_mask.cuda(),
                "loss_weights": p.loss_mask.cuda(),
                "packed_seq_params": psp,
                "real": sum(lengths[i] for i in b),
                "slots": a.pack_len,
            }
        )

    def padded_rows(k, pad_to):
        group = [samples[order[(k * a.micro_batch + j) % len(order)]] for j in range(a.micro_batch)]
        width = pad_to or max(s["tokens"].numel() for s in group)
        tok = torch.zeros(a.micro_batch, width, dtype=torch.long)
        lab = torch.zeros_like(tok)
        mask = torch.zeros(a.micro_batch, width)
        attn = torch.zeros(a.micro_batch, width, dtype=torch.long)
        for j, s in enumerate(group):
            n = s["tokens"].numel()
            tok[j, :n], lab[j, :n], mask[j, :n], attn[j, :n] = s["tokens"], s["labels"], s["loss_mask"], 1
        return {
            "tokens": tok.cuda(),
            "labels": lab.cuda(),
            "loss_mask": mask.cuda(),
            "loss_weights": mask.cuda(),
            "attention_mask": attn.cuda(),
            "real": sum(s["tokens"].numel() for s in group),
            "slots": a.micro_batch * width,
        }

    unpacked = [padded_rows(k, a.max_len) for k in range(n_steps)]
    dynamic = [padded_rows(k, None) for k in range(n_steps)]
    print(
        f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}; {len(samples)} samples, mean length {sum(lengths) / len(lengths):.0f}, "
        f"whole-set packing efficiency {packing_efficiency(lengths, bins, a.pack_len):.1%} into {a.pack_len}-token rows",
        flush=True,
    )

    def hf_trainer_style():
        step0, keep = hf_step(mcfg, dynamic[0]["tokens"], compile_=False)
        model, opt = keep[0], keep[1]
        it = iter(dynamic)

        def step():
            mb = next(it)
            labels = torch.where(mb["loss_mask"] > 0, mb["labels"], torch.full_like(mb["labels"], -100))
            opt.zero_grad(set_to_none=True)
            # HF shifts labels itself: give it the unshifted next-token targets as its inputs' labels
            labels = torch.cat([torch.full_like(labels[:, :1], -100), labels[:, :-1]], dim=1)
            model(input_ids=mb["tokens"], attention_mask=mb["attention_mask"], labels=labels).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            opt.step()

        return step, keep, None

    setups = {
        "loongforge packed": (lambda: loongforge_setup(mcfg, packed, True), packed),
        "loongforge unpacked": (lambda: loongforge_setup(mcfg, unpacked, False), unpacked),
        "hf trainer-style": (hf_trainer_style, dynamic),
    }
    for name, (build, data) in setups.items():
        step, keep, attn = build()
        ms, mem = timed(step, a.warmup, a.steps)
        timed_batches = data[a.warmup : a.warmup + a.steps]
        real = sum(b["real"] for b in timed_batches)
        slots = sum(b["slots"] for b in timed_batches)
        tps = real / (ms * a.steps / 1e3)
        results[name] = {"ms_per_step": ms, "real_tokens_per_s": tps, "efficiency": real / slots, "peak_gib": mem, "attention": attn}
        print(
            f"{name}: {ms:.1f} ms/step, {tps:,.0f} real tok/s, efficiency {real / slots:.1%}, peak {mem:.1f} GiB"
            + (f", varlen attention {attn}" if attn else ""),
            flush=True,
        )
        del step, keep
        gc.collect()
        torch.cuda.empty_cache()
    print("\n| setup | ms/step | real tokens/s | packing efficiency | peak GiB |\n| --- | --- | --- | --- | --- |")
    for n, r in results.items():
        print(f"| {n} | {r['ms_per_step']:.1f} | {r['real_tokens_per_s']:,.0f} | {100 * r['efficiency']:.1f}% | {r['peak_gib']:.1f} |")
    base = results["hf trainer-style"]["real_tokens_per_s"]
    for n in ("loongforge packed", "loongforge unpacked"):
        print(f"ratio {n} / hf trainer-style: {results[n]['real_tokens_per_s'] / base:.2f}x real tokens/s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": vars(a), "results": results, "gpu": torch.cuda.get_device_name()}, f, indent=1)


if __name__ == "__main__":
    main()
