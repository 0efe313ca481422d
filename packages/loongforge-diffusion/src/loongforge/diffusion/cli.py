"""`loongforge-diffusion`: train Wan video and Qwen-Image diffusion transformers, preprocess media
into latents, generate, and convert to diffusers' format."""

from __future__ import annotations

import argparse

from loongforge.core.errors import cli_entry

EXAMPLES = """examples:
  loongforge-diffusion train wan_tiny                          # demo: generated videos, tiny VAE / text encoder, CPU ok
  loongforge-diffusion train wan_tiny train.train_iters=20 checkpoint.run_dir=runs/wan
  loongforge-diffusion preprocess clips/ latents/ --vae /models/Wan2.1-T2V-1.3B-Diffusers \\
      --text-encoder /models/Wan2.1-T2V-1.3B-Diffusers --buckets 480x832x81 832x480x81 --fps 16
  loongforge-diffusion train wan2.1_t2v_1.3b data.root=latents/ checkpoint.load=/models/Wan2.1-T2V-1.3B-Diffusers/transformer
  torchrun --nproc-per-node 8 -m loongforge.diffusion.cli train run.yaml parallel.data_parallel_mode=fsdp
  torchrun --nproc-per-node 8 -m loongforge.diffusion.cli train run.yaml parallel.context_parallel_size=4   # long videos (Ulysses)
  torchrun --nproc-per-node 8 -m loongforge.diffusion.cli train run.yaml parallel.stack=megatron \
      parallel.tensor_model_parallel_size=2 parallel.context_parallel_size=4   # large models: heads split over TP
  loongforge-diffusion train run.yaml boundary_ratio=0.875 checkpoint.load=/models/Wan2.2-T2V-A14B-Diffusers   # both experts
  loongforge-diffusion generate runs/tiny-wan --prompt "a red square moving right" --out red.mp4
  loongforge-diffusion generate runs/ti2v --prompt "the square moves right" --image first.png --out clip.mp4
  loongforge-diffusion train wan_i2v_tiny                      # Wan2.1 image-to-video demo (tiny CLIP image encoder)
  loongforge-diffusion generate runs/tiny-wan-i2v --prompt "a red square moving right" --image first.png --out clip.mp4
  loongforge-diffusion convert runs/tiny-wan export/transformer    # diffusers WanTransformer3DModel directory
  loongforge-diffusion train qwen_image_tiny                   # Qwen-Image (MMDiT) on the demo's first frames
  loongforge-diffusion preprocess images/ latents/ --family qwen_image --vae /models/Qwen-Image --text-encoder /models/Qwen-Image --buckets 1024x1024x1
  loongforge-diffusion generate runs/tiny-qwen-image --prompt "a red square" --frames 1 --out red.png
Errors you can fix print one line and exit 2; add --debug for the traceback."""


def parser() -> argparse.ArgumentParser:
    fmt = {"epilog": EXAMPLES, "formatter_class": argparse.RawDescriptionHelpFormatter}
    p = argparse.ArgumentParser(
        prog="loongforge-diffusion", description="Diffusion transformers (Wan video, Qwen-Image) with LoongForge.", **fmt
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train from a YAML config", **fmt)
    t.add_argument("config", help="YAML file, or the name of a shipped config (wan_tiny, wan2.1_t2v_1.3b)")
    t.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.lr=1e-4")
    pp = sub.add_parser("preprocess", help="encode captioned videos / images into latent shards (resumable)", **fmt)
    pp.add_argument("source", help="a folder with captions.jsonl ({video|image, caption} per line) or metadata.csv")
    pp.add_argument("out", help="the output directory (new, or an interrupted run of the same settings to resume)")
    pp.add_argument("--vae", default="tiny", help="AutoencoderKLWan directory (or a Wan pipeline directory), or tiny")
    pp.add_argument("--text-encoder", default="tiny", help="UMT5 encoder + tokenizer directory (or a Wan pipeline directory), or tiny")
    pp.add_argument("--buckets", nargs="+", default=["480x832x81"], help="HxWxF buckets (F = 4k + 1; sides multiples of 16)")
    pp.add_argument("--fps", type=float, default=16.0, help="frame rate videos are sampled at (0: every frame)")
    pp.add_argument("--shard-size", type=int, default=64)
    pp.add_argument("--on-bad-sample", choices=["skip", "error"], default="skip")
    pp.add_argument(
        "--family", choices=["wan", "qwen_image"], default="wan", help="whose VAE and text states (qwen_image: images, 1-frame buckets)"
    )
    pp.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the encoders' dtype")
    pp.add_argument(
        "--image-encoder",
        default=None,
        help="Wan2.1 image-to-video: a CLIP vision encoder (a Wan I2V pipeline directory, or tiny); also stores each sample's "
        "condition latents and first-frame CLIP features",
    )
    g = sub.add_parser("generate", help="a video (.mp4) or image (.png) from a trained run", **fmt)
    g.add_argument("run_dir")
    g.add_argument("--prompt", required=True)
    g.add_argument("--out", required=True, help="a new .mp4 or .png file")
    g.add_argument("--negative-prompt", default="")
    g.add_argument(
        "--image",
        default=None,
        help="image-to-video: the first frame (Wan2.1 I2V runs: required, the pipeline's mask, condition latents and CLIP features; "
        "Wan2.2 TI2V: held clean while the rest is sampled)",
    )
    g.add_argument("--frames", type=int, default=9, help="4k + 1 frames (1 for an image)")
    g.add_argument("--height", type=int, default=64)
    g.add_argument("--width", type=int, default=64)
    g.add_argument("--steps", type=int, default=20)
    g.add_argument("--guidance", type=float, default=5.0, help="classifier-free guidance scale (<= 1: none)")
    g.add_argument(
        "--scheduler", choices=["unipc", "euler"], default=None, help="default: the family's pipeline's (Wan: unipc, Qwen-Image: euler)"
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--fps", type=int, default=16)
    g.add_argument("--device", default="cpu")
    c = sub.add_parser("convert", help="a trained run's transformer as a diffusers WanTransformer3DModel directory", **fmt)
    c.add_argument("run_dir", help="a run directory of `train` (its newest checkpoint is converted)")
    c.add_argument("out", help="a new (or empty) directory")
    for sp in (g, c):
        sp.add_argument("--weights", choices=["auto", "ema", "trained"], default="auto", help="auto: the EMA where the run kept one")
    return p


@cli_entry
def main(argv: list[str]) -> int:
    args = parser().parse_args([a for a in argv if a != "--debug"])
    if args.cmd == "train":
        from loongforge.core.recipes import train

        return train(args.config, args.overrides, prefer="diffusion")
    if args.cmd == "preprocess":
        import json

        import torch
        from loongforge.diffusion.data.preprocess import preprocess

        summary = preprocess(
            args.source,
            args.out,
            vae_spec=args.vae,
            text_spec=args.text_encoder,
            buckets=args.buckets,
            fps=args.fps or None,
            shard_size=args.shard_size,
            on_bad_sample=args.on_bad_sample,
            dtype=getattr(torch, args.dtype),
            family=args.family,
            image_spec=args.image_encoder,
        )
        print(json.dumps(summary))
        return 0
    ema = {"auto": None, "ema": True, "trained": False}[args.weights]
    if args.cmd == "generate":
        from loongforge.diffusion.generate import generate

        out = generate(
            args.run_dir,
            args.prompt,
            args.out,
            frames=args.frames,
            height=args.height,
            width=args.width,
            steps=args.steps,
            guidance=args.guidance,
            negative_prompt=args.negative_prompt,
            seed=args.seed,
            scheduler=args.scheduler,
            fps=args.fps,
            device=args.device,
            ema=ema,
            image=args.image,
        )
        print(f"wrote {out}")
        return 0
    from loongforge.diffusion.model_io import export_run

    print(f"wrote {export_run(args.run_dir, args.out, ema)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
