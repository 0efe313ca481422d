"""`loongforge-vlm`: train vision-language models, answer about an image, convert to HF."""

from __future__ import annotations

import argparse

from loongforge.core.errors import UserError, cli_entry

EXAMPLES = """examples:
  loongforge-vlm train qwen2_5_vl_tiny                      # demo: generated shapes with questions, CPU ok
  loongforge-vlm train qwen2_5_vl_tiny model.language.family=llama   # the same ViT under another language model
  loongforge-vlm train run.yaml checkpoint.load=/models/Qwen2.5-VL-7B-Instruct data.paths=[llava.json] \\
      data.tokenizer=/models/Qwen2.5-VL-7B-Instruct freeze.vision=true
  loongforge-vlm preprocess qwen2_5_vl_tiny packs/tiny     # encode and pack once (the run config's data section)
  loongforge-vlm train qwen2_5_vl_tiny data.prepacked=packs/tiny
  loongforge-vlm generate runs/tiny-vlm --image shape.png --prompt "What color is the shape?"
  loongforge-vlm convert runs/tiny-vlm export/          # an HF Qwen2_5_VLForConditionalGeneration directory
  loongforge-vlm convert runs/lora-vlm adapter/ --peft  # a LoRA run's adapters for transformers + peft
  loongforge-vlm convert runs/lora-vlm adapter/ --peft --base /models/Qwen2.5-VL-7B-Instruct   # the base recorded
Errors you can fix print one line and exit 2; add --debug for the traceback."""


def parser() -> argparse.ArgumentParser:
    fmt = {"epilog": EXAMPLES, "formatter_class": argparse.RawDescriptionHelpFormatter}
    p = argparse.ArgumentParser(prog="loongforge-vlm", description="Vision-language models with LoongForge.", **fmt)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train from a YAML config", **fmt)
    t.add_argument("config", help="YAML file, or the name of a shipped config (qwen2_5_vl_tiny)")
    t.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.lr=1e-4")
    pp = sub.add_parser("preprocess", help="encode and pack a run config's data once into a directory (data.prepacked)", **fmt)
    pp.add_argument("config", help="the run's YAML file or a shipped config name: its model and data sections decide the packs")
    pp.add_argument("out", help="a new (or empty) directory")
    pp.add_argument("overrides", nargs="*", help="key=value overrides, e.g. data.seq_length=4096")
    g = sub.add_parser("generate", help="answer a prompt about an image with a trained run or an HF directory", **fmt)
    g.add_argument("model", help="a run directory of `train`, a checkpoint, or an HF Qwen2.5-VL directory")
    g.add_argument("--prompt", required=True)
    g.add_argument("--image", action="append", default=[], help="an image file (repeat for several)")
    g.add_argument("--max-new-tokens", type=int, default=16)
    c = sub.add_parser("convert", help="a trained run as an HF directory (LoRA merged), or its LoRA adapters for PEFT", **fmt)
    c.add_argument("run_dir", help="a run directory of `train` (its newest checkpoint is converted)")
    c.add_argument("out", help="a new (or empty) directory")
    c.add_argument(
        "--peft",
        action="store_true",
        help="a LoRA run's adapters (and the vision parts it trained) as a PEFT adapter directory, not merged",
    )
    c.add_argument("--base", help="with --peft: the HF base model directory the adapter records (default: the run's checkpoint.load)")
    return p


@cli_entry
def main(argv: list[str]) -> int:
    args = parser().parse_args([a for a in argv if a != "--debug"])
    if args.cmd == "train":
        from loongforge.core.recipes import train

        return train(args.config, args.overrides, prefer="vlm")
    if args.cmd == "preprocess":
        import json

        from loongforge.core.recipes import resolve
        from loongforge.vlm.prepacked import write_prepacked
        from loongforge.vlm.recipe import prepare_for_packing

        recipe, cfg = resolve(args.config, args.overrides, prefer="vlm")
        if recipe.package != "vlm":
            raise UserError(f"{args.config} is a {recipe.name} config, not a VLM one")
        cfg, tok = prepare_for_packing(cfg)
        print(json.dumps(write_prepacked(cfg, tok, args.out)))
        return 0
    if args.cmd == "generate":
        from loongforge.vlm.generate import answer

        print(answer(args.model, args.prompt, args.image, args.max_new_tokens))
        return 0
    from loongforge.vlm.model_io import export_hf, lf_to_peft

    if args.peft:
        print(f"wrote {lf_to_peft(args.run_dir, args.out, args.base)}")
        return 0
    if args.base is not None:
        raise UserError("--base names the base model a PEFT adapter records: use it with --peft")
    print(f"wrote {export_hf(args.run_dir, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
