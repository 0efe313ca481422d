"""`loongforge-llm`: train, preprocess, convert, generate."""

from __future__ import annotations

import argparse
import json
import sys

from loongforge.core.errors import UserError, cli_entry

EXAMPLES = """examples:
  loongforge-llm train tiny                                   # demo: shipped tiny corpus + model, CPU ok
  loongforge-llm train tiny train.train_iters=20 checkpoint.run_dir=runs/t
  loongforge-llm train sft checkpoint.load=runs/tiny/hf    # SFT demo: shipped alpaca set, packing
  loongforge-llm train lora checkpoint.load=runs/tiny/hf   # LoRA SFT demo: adapters only, PEFT export
  loongforge-llm train run.yaml train.lr=3e-4 parallel.tensor_model_parallel_size=2
  torchrun --nproc-per-node 2 -m loongforge.llm.cli train run.yaml parallel.pipeline_model_parallel_size=2
  loongforge-llm train run.yaml checkpoint.load=/models/Llama-3.2-1B   # start from HF weights
  loongforge-llm preprocess --input corpus.jsonl --tokenizer /models/Llama-3.2-1B --output-prefix data/corpus
  loongforge-llm convert hf-to-lf /models/Qwen3-0.6B ckpt/qwen3
  loongforge-llm convert lf-to-hf runs/t ckpt/t-hf                  # LoRA runs: adapters merged in
  loongforge-llm convert lf-to-peft runs/lora ckpt/lora-adapter     # LoRA adapters for transformers + peft
  loongforge-llm generate runs/t --prompt "Ada gave the" --max-new-tokens 8
Errors you can fix print one line and exit 2; add --debug for the traceback."""

PREPROCESS_EXAMPLES = """examples:
  loongforge-llm preprocess --input corpus.jsonl --tokenizer /models/Llama-3.2-1B --output-prefix data/corpus --workers 8
  loongforge-llm preprocess --sft --input chats.jsonl --format openai --tokenizer /models/Qwen3-8B --template qwen3 \\
      --seq-length 8192 --output-dir data/chats-8k
  loongforge-llm preprocess --sft --input chats.jsonl --format openai --tokenizer /models/Qwen3-8B --dry-run 3   # what is trained
  loongforge-llm train sft data.prepacked=data/chats-8k data.tokenizer=/models/Qwen3-8B data.seq_length=8192 checkpoint.load=/models/Qwen3-8B"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loongforge-llm",
        description="LLM training with LoongForge.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train from a YAML config", epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("config", help="YAML file, or the name of a shipped config (tiny)")
    t.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.lr=3e-4")
    pp = sub.add_parser(
        "preprocess",
        help="pretraining text -> megatron .bin/.idx; --sft: conversations -> packed parquet",
        epilog=PREPROCESS_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    pp.add_argument(
        "--input", nargs="+", required=True, help="jsonl/json/parquet/arrow/csv/txt files or directories (--sft: one file or directory)"
    )
    pp.add_argument("--tokenizer", required=True, help="HF tokenizer directory, or 'tiny'")
    pp.add_argument("--output-prefix", help="pretraining: writes PREFIX.bin and PREFIX.idx")
    pp.add_argument("--text-key", default="text")
    pp.add_argument("--workers", type=int, default=1)
    sft = pp.add_argument_group("SFT (--sft): chat template, loss mask and packing, as the sft recipe's data section")
    sft.add_argument("--sft", action="store_true", help="tokenize conversations with a chat template and pack them into --output-dir")
    sft.add_argument("--output-dir", help="--sft: a new directory for the parquet shards (train with data.prepacked=DIR)")
    sft.add_argument("--format", default="alpaca", help="alpaca | sharegpt | openai")
    sft.add_argument("--keys", default="{}", help='field-name overrides as JSON, e.g. \'{"messages": "chat"}\'')
    sft.add_argument(
        "--template",
        default=None,
        help="built-in chat template, the published one of: llama3, llama3.1, llama3.2, qwen2 (Qwen2.5), qwen3, deepseek_v3, gemma; "
        "default: the tokenizer's own",
    )
    sft.add_argument(
        "--template-kwargs", default="{}", help="the template's variables as JSON, e.g. '{\"enable_thinking\": false}' for qwen3"
    )
    sft.add_argument("--seq-length", type=int, default=4096)
    sft.add_argument("--no-packing", action="store_true", help="one padded sample per row")
    sft.add_argument("--train-on-prompt", action="store_true")
    sft.add_argument("--last-turn-only", action="store_true")
    sft.add_argument("--no-reasoning-loss", action="store_true", help="no loss on the reasoning (the <think> block) of assistant turns")
    sft.add_argument("--append-eos", action="store_true")
    sft.add_argument("--on-bad-sample", default="skip", choices=["skip", "error"])
    sft.add_argument("--seed", type=int, default=1234, help="order of the samples before packing")
    sft.add_argument(
        "--dry-run",
        type=int,
        metavar="N",
        default=0,
        help="print the first N rows as rendered, trained tokens between [[ and ]], bad rows with their reason; write nothing",
    )
    c = sub.add_parser(
        "convert", help="HF <-> LoongForge checkpoints", epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    c.add_argument("direction", choices=["hf-to-lf", "lf-to-hf", "lf-to-peft"])
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="lf-to-hf: dtype of the written weights")
    c.add_argument("--base", default=None, help="LoRA checkpoints: base model (default: the checkpoint.load it was trained from)")
    g = sub.add_parser("generate", help="greedy generation from an HF dir or checkpoint")
    g.add_argument("model")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--tokenizer", default=None, help="default: the checkpoint's own tokenizer")
    g.add_argument("--base", default=None, help="LoRA checkpoints: base model (default: the checkpoint.load it was trained from)")
    return p


@cli_entry
def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.cmd == "train":
        from loongforge.core.recipes import train

        return train(args.config, args.overrides, prefer="llm")  # `loongforge train`, llm's configs and recipe names first
    if args.cmd == "preprocess":
        from loongforge.core.data.text import load_tokenizer

        if args.sft:
            return preprocess_sft(args)
        from loongforge.llm.data import preprocess

        if not args.output_prefix:
            raise UserError("preprocess needs --output-prefix (or --sft with --output-dir)")
        if args.workers < 1:
            raise UserError("--workers must be at least 1")
        info = preprocess(args.input, load_tokenizer(args.tokenizer), args.output_prefix, args.text_key, args.workers)
        print(json.dumps(info))
        return 0
    if args.cmd == "convert":
        from loongforge.llm import model_io

        if args.direction == "hf-to-lf":
            out = model_io.hf_to_lf(args.src, args.dst)
        elif args.direction == "lf-to-peft":
            out = model_io.lf_to_peft(args.src, args.dst, args.base)
        else:
            import torch

            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
            out = model_io.lf_to_hf(args.src, args.dst, dtype, args.base)
        print(f"wrote {out}")
        return 0
    if args.cmd == "generate":
        return generate(args)
    return 2


def preprocess_sft(args) -> int:
    from loongforge.core.data.text import SFTDataConfig, SFTDatasetConfig, load_tokenizer, write_prepacked

    if not args.output_dir and not args.dry_run:
        raise UserError("preprocess --sft needs --output-dir (or --dry-run N to look at N rows)")
    if args.dry_run < 0:
        raise UserError(f"--dry-run={args.dry_run} must be a number of rows (at least 1)")
    if len(args.input) != 1:
        raise UserError("preprocess --sft takes one --input (a file, or a directory of shards)")
    if args.seq_length < 2:
        raise UserError(f"--seq-length={args.seq_length} is too short")
    try:
        keys = json.loads(args.keys)
    except json.JSONDecodeError:
        raise UserError(f"--keys is not a JSON object: {args.keys}") from None
    try:
        template_kwargs = json.loads(args.template_kwargs)
    except json.JSONDecodeError:
        template_kwargs = None
    if not isinstance(template_kwargs, dict):
        raise UserError(f"--template-kwargs is not a JSON object: {args.template_kwargs}")
    d = SFTDataConfig(
        datasets=[SFTDatasetConfig(path=args.input[0], format=args.format, keys=keys)],
        tokenizer=args.tokenizer,
        template=args.template,
        template_kwargs=template_kwargs,
        seq_length=args.seq_length,
        packing=not args.no_packing,
        train_on_prompt=args.train_on_prompt,
        last_turn_only=args.last_turn_only,
        train_on_reasoning=not args.no_reasoning_loss,
        append_eos=args.append_eos,
        on_bad_sample=args.on_bad_sample,
    )
    tok = load_tokenizer(args.tokenizer)
    if args.dry_run:
        return dry_run(d, tok, args.dry_run)
    print(json.dumps(write_prepacked(d, tok, args.output_dir, args.seed)))
    return 0


def dry_run(d, tok, n: int) -> int:
    """The first `n` rows of the (one) dataset as the model sees them, trained tokens marked."""
    from loongforge.core.data.text import IGNORE, BadSample, sft_rows, sft_tokenizer, to_messages
    from loongforge.core.data.text.assistant_mask import marked_text

    st = sft_tokenizer(d, tok)
    ds = d.datasets[0]
    rows = sft_rows(ds.path)
    print(f"{min(n, len(rows))} of {len(rows)} rows of {ds.path} ({ds.format}); trained tokens between [[ and ]]")
    for i in range(min(n, len(rows))):
        try:
            conv = to_messages(rows[i], ds.format, ds.keys)
            sample = st(conv.messages, tools=conv.tools)
        except BadSample as e:
            print(f"--- row {i}: bad row, skipped in training ({e})")
            continue
        trained = [x != IGNORE for x in sample["labels"]]
        print(f"--- row {i}: {len(trained)} tokens, {sum(trained)} trained")
        print(marked_text(tok, sample["input_ids"], trained))
    return 0


def generate(args) -> int:
    import torch
    from loongforge.core.data.text import load_tokenizer, tokenizer_dir_for
    from loongforge.llm.model_io import load_model

    if not args.prompt:
        raise UserError('--prompt is empty; give the text to continue, e.g. --prompt "Ada gave the"')
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens={args.max_new_tokens} must be at least 1")
    tok_path = args.tokenizer
    if tok_path is None:
        found = tokenizer_dir_for(args.model)
        if found is None:
            raise UserError(f"no tokenizer found with {args.model}; pass --tokenizer")
        tok_path = str(found)
    tok = load_tokenizer(tok_path)
    prompt_ids = tok(args.prompt, add_special_tokens=False)["input_ids"]
    if not prompt_ids:
        raise UserError(f"--prompt {args.prompt!r} encodes to no tokens with the tokenizer at {tok_path}; give some text")
    model = load_model(args.model, args.base)
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, args.max_new_tokens, eos_token_id=tok.eos_token_id)
    print(tok.decode(out[0].tolist()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
