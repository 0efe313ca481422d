"""How evenly vision-language global batches spread over data-parallel ranks: contiguous split
(what `rank_micro_batches` does), round-robin, and `balanced_rank_samples`
(`loongforge.core.data.balance`), scored by max / mean per-rank cost (1.0 is perfect balance;
the slowest rank sets the step time, so max / mean - 1 is the time the other ranks wait).

Samples are drawn with a fixed seed from this length mix (`--mix` changes the shares):

  text    text-only, 128-2048 tokens
  image   one image of 256-1280 LLM tokens, plus 16-512 text tokens
  multi   2-8 images of 64-768 LLM tokens each, plus 32-1024 text tokens
  video   a short video of 2k-8k LLM tokens, plus 32-512 text tokens
  long    a long video of 16k-32k LLM tokens, plus 32-512 text tokens

at default shares text 0.10, image 0.55, multi 0.20, video 0.10, long 0.05 (all lengths uniform
in their ranges). Vision patches: 4 per merged LLM token (Qwen2.5-VL's 2x2 merge). An image is
one ViT attention segment of its patches; a video is one segment of 1024 patches per frame group
(a 448x448 pair of frames, 256 LLM tokens), as Qwen2.5-VL's full-attention layers attend within
a frame group (`--video-attention whole` makes the whole video one segment instead).

Cost model: FLOPs of forward + backward (3x forward) of a Qwen2.5-VL-7B-like shape, everything
trained:
  LLM  28 layers, hidden 3584, 28 query / 4 key-value heads of 128, SwiGLU 18944, vocab 152064:
       linear = 6 * (28 * (3584 * (3584 + 2 * 512) + 3584^2 + 3 * 3584 * 18944) + 3584 * 152064)
              = 4.24e10 per token
       quadratic (causal attention: T^2 / 2 pairs, 2 matmuls of 2 * 3584 FLOPs per pair, x3)
              = 28 * 3 * 4 * 3584 / 2 = 6.02e5 per token^2
  ViT  32 layers, hidden 1280, SwiGLU 3420, 14x14x2 patches, 2x2 merger MLP 5120 -> 5120 -> 3584;
       28 layers of window attention over 64 patches (linear), 4 of full attention:
       linear = 6 * (32 * (4 * 1280^2 + 3 * 1280 * 3420) + 1176 * 1280 + (5120^2 + 5120 * 3584) / 4)
              + 28 * 3 * 4 * 1280 * 64 = 3.91e9 per patch
       quadratic (non-causal) = 4 * 3 * 4 * 1280 = 6.14e4 per patch^2 of a segment
  constant 0. The LLM's quadratic term equals its linear one at ~70k tokens, so a 32k video costs
  ~1.5x its token count's linear share; a ViT over frame groups is almost linear.
Balancing uses the same cost model that scores it (an exact model); a fitted model's error adds
to the imbalance shown.

Samples are drawn independently, so contiguous and round-robin are both random splits and score
alike; they differ only on data whose order carries length (sorted or grouped by source).

The lower bound (`imbalance_lower_bound`): no split with per_rank samples a rank beats it; the
simplest of its terms is (heaviest sample + the per_rank - 1 cheapest others) / mean, and it
also counts the j heaviest samples together with the cheapest samples that must fill their
ranks. With few samples per rank one long video costs about the mean per-rank load or more, and
no split reaches 1.05 on that batch: the "bound > t" column counts those batches, "bal. where
possible" scores the others (mean / worst), and "bal./bound" is the worst ratio of the balanced
split to the bound (1.000: provably optimal on every batch).

Examples:

  python tools/benchmarks/vlm_balance_sim.py
  python tools/benchmarks/vlm_balance_sim.py --dp 8 64 --per-rank 4 64 --batches 50
  python tools/benchmarks/vlm_balance_sim.py --mix text=0.2,image=0.5,multi=0.2,video=0.1,long=0 --seed 1
  python tools/benchmarks/vlm_balance_sim.py --video-attention whole
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from loongforge.core.data import SampleCost, assign, balanced_rank_samples, imbalance, imbalance_lower_bound, rank_micro_batches

KINDS = ("text", "image", "multi", "video", "long")
DEFAULT_MIX = {"text": 0.10, "image": 0.55, "multi": 0.20, "video": 0.10, "long": 0.05}
PATCHES_PER_TOKEN = 4
FRAME_GROUP_TOKENS = 256  # a 448x448 pair of frames: 32x32 patches, 2x2 merged


def qwen25_vl_7b_cost() -> SampleCost:
    """FLOPs of forward + backward per the shape in the module docstring."""
    h, layers, kv, mlp, vocab = 3584, 28, 512, 18944, 152064
    llm_linear = 6 * (layers * (h * (h + 2 * kv) + h * h + 3 * h * mlp) + h * vocab)
    llm_quadratic = layers * 3 * 4 * h / 2
    vh, vlayers, vmlp, window, full = 1280, 32, 3420, 64, 4
    vit_linear = 6 * (vlayers * (4 * vh * vh + 3 * vh * vmlp) + 14 * 14 * 2 * 3 * vh + (5120 * 5120 + 5120 * 3584) / 4)
    vit_linear += (vlayers - full) * 3 * 4 * vh * window
    vit_quadratic = full * 3 * 4 * vh
    return SampleCost(llm_quadratic=llm_quadratic, llm_linear=llm_linear, vit_quadratic=vit_quadratic, vit_linear=vit_linear)


def draw_sample(rng: np.random.Generator, mix: dict[str, float], whole_video: bool) -> tuple[str, int, list[int]]:
    """(kind, llm_tokens, vision segments in patches) of one sample of the mix."""
    kind = KINDS[rng.choice(len(KINDS), p=[mix[k] for k in KINDS])]
    if kind == "text":
        return kind, int(rng.integers(128, 2049)), []
    if kind == "image":
        m = int(rng.integers(256, 1281))
        return kind, m + int(rng.integers(16, 513)), [PATCHES_PER_TOKEN * m]
    if kind == "multi":
        ms = [int(x) for x in rng.integers(64, 769, size=int(rng.integers(2, 9)))]
        return kind, sum(ms) + int(rng.integers(32, 1025)), [PATCHES_PER_TOKEN * m for m in ms]
    lo, hi = (2048, 8192) if kind == "video" else (16384, 32768)
    groups = int(rng.integers(lo, hi + 1)) // FRAME_GROUP_TOKENS
    tokens = groups * FRAME_GROUP_TOKENS
    segments = [PATCHES_PER_TOKEN * tokens] if whole_video else [PATCHES_PER_TOKEN * FRAME_GROUP_TOKENS] * groups
    return kind, tokens + int(rng.integers(32, 513)), segments


def simulate(dp: int, per_rank: int, batches: int, rng: np.random.Generator, mix: dict[str, float], model: SampleCost, whole: bool) -> dict:
    gb = dp * per_rank
    costs = [model.cost(t, p) for _, t, p in (draw_sample(rng, mix, whole) for _ in range(batches * gb))]
    scores: dict[str, list[float]] = {"contiguous": [], "round_robin": [], "balanced": [], "bound": []}
    for step in range(batches):
        base = step * gb
        batch = costs[base : base + gb]

        def local(shares: list[list[int]]) -> list[list[int]]:
            return [[i - base for i in share] for share in shares]

        contiguous = [[i for mb in rank_micro_batches(step, gb, 1, r, dp) for i in mb] for r in range(dp)]
        balanced = assign(batch, dp, per_rank)  # what balanced_rank_samples hands out, computed once
        if step < 2:  # every rank's own call gives its share of that assignment
            mine = [balanced_rank_samples(step, gb, r, dp, costs.__getitem__) for r in range(dp)]
            if local(mine) != balanced:
                raise SystemExit(f"error: balanced_rank_samples differs from assign at dp {dp}, per rank {per_rank}, step {step}")
        scores["contiguous"].append(imbalance(batch, local(contiguous)))
        scores["round_robin"].append(imbalance(batch, [list(range(r, gb, dp)) for r in range(dp)]))
        scores["balanced"].append(imbalance(batch, balanced))
        scores["bound"].append(imbalance_lower_bound(batch, dp, per_rank))
    return {k: np.asarray(v) for k, v in scores.items()}


def parse_mix(text: str) -> dict[str, float]:
    mix = dict.fromkeys(KINDS, 0.0)
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in mix:
            raise argparse.ArgumentTypeError(f"kind=share pairs of {', '.join(KINDS)}, got {part!r}")
        try:
            mix[key.strip()] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"a share must be a number, got {part!r}") from None
    total = sum(mix.values())
    if total <= 0 or any(v < 0 for v in mix.values()):
        raise argparse.ArgumentTypeError("shares must be non-negative and not all zero")
    return {k: v / total for k, v in mix.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, nargs="+", default=[8, 16, 32], help="data-parallel sizes (default: 8 16 32)")
    ap.add_argument("--per-rank", type=int, nargs="+", default=[8, 16, 32], help="samples per rank; global batch = dp * per-rank")
    ap.add_argument("--batches", type=int, default=200, help="global batches drawn per (dp, per-rank) (default: 200)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mix", type=parse_mix, default=DEFAULT_MIX, help="shares, e.g. text=0.1,image=0.55,multi=0.2,video=0.1,long=0.05")
    ap.add_argument("--video-attention", choices=("frame", "whole"), default="frame", help="ViT segment of a video (default: frame)")
    ap.add_argument("--target", type=float, default=1.05, help="max / mean counted as balanced (default: 1.05)")
    args = ap.parse_args(argv)
    if args.batches < 1 or min(args.dp) < 1 or min(args.per_rank) < 1:
        raise SystemExit("error: --dp, --per-rank and --batches must be positive")

    model = qwen25_vl_7b_cost()
    mix = ", ".join(f"{k} {v:.2f}" for k, v in args.mix.items())
    print(f"cost model (FLOPs, fwd+bwd): {model}")
    print(f"mix: {mix}; video ViT segments: {args.video_attention}; seed {args.seed}; {args.batches} global batches per row")
    print("max/mean per-rank cost, mean and worst over the batches; t = target", args.target)
    head = (
        f"{'dp':>3} {'per rank':>8} {'batch':>5} | {'contiguous':>13} | {'round-robin':>13} | {'balanced':>13} | "
        f"{'lower bound':>13} | {'bal. <= t':>9} | {'bound > t':>9} | {'bal. where possible':>19} | {'bal./bound':>10}"
    )
    print(head)
    print("-" * len(head))
    missed = []
    for dp in args.dp:
        for per_rank in args.per_rank:
            rng = np.random.default_rng([args.seed, dp, per_rank])
            s = simulate(dp, per_rank, args.batches, rng, args.mix, model, args.video_attention == "whole")
            possible = s["bound"] <= args.target
            hit = s["balanced"] <= args.target + 1e-12
            where = f"{s['balanced'][possible].mean():.3f} / {s['balanced'][possible].max():.3f}" if possible.any() else "none possible"
            cells = [f"{s[k].mean():.3f} / {s[k].max():.3f}" for k in ("contiguous", "round_robin", "balanced", "bound")]
            print(
                f"{dp:>3} {per_rank:>8} {dp * per_rank:>5} | {' | '.join(f'{c:>13}' for c in cells)} | "
                f"{f'{hit.sum()}/{args.batches}':>9} | {f'{(~possible).sum()}/{args.batches}':>9} | {where:>19} | "
                f"{(s['balanced'] / s['bound']).max():>10.3f}"
            )
            if np.any(possible & ~hit):
                missed.append(
                    f"dp {dp}, per rank {per_rank}: {int(np.sum(possible & ~hit))} batches above {args.target} with a lower bound below it"
                )
    print(
        f"\nbound > t: batches on which no split with equal samples per rank reaches {args.target}: their heaviest samples, with\n"
        "the cheapest samples that must share their ranks, cost more than that times the mean per-rank load (long videos\n"
        "among few samples per rank). More samples per rank (a larger global batch) make the target reachable."
    )
    print("\n".join(missed) if missed else f"every batch that could reach {args.target} did.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
