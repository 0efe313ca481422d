"""How evenly an MoE layer's tokens spread over its expert-parallel ranks, with and without
hot-expert replication (`loongforge.core.parallel.expert_placement`).

For each step t after the first `--window` steps, the replication plan is made from the token
counts of steps t-W .. t-1 summed, and both layouts are scored on step t by max / mean tokens
per EP rank (1.0 is perfect balance). The plan never sees the step it is scored on.

Loads come from a routing trace or are synthetic:

  --trace FILE       JSON Lines, one object per (step, layer):
                       {"step": 12, "layer": 3, "tokens_per_expert": [310, 12, ...]}
                     (what the trainer writes to <run_dir>/routing_trace.jsonl); each layer is
                     simulated on its own, and the report adds the mean over layers.
  --synthetic zipf:S expert popularity ~ 1 / rank^S over a random permutation of the experts
                     (zipf:0 is uniform routing).
  --synthetic hot:K:F K random experts receive fraction F of all tokens, the rest uniformly.

Synthetic popularity drifts: each step, with probability --drift, two random experts swap their
popularity. Each token picks top-k distinct experts, drawn without replacement in proportion to
the popularity (Gumbel top-k), as a router's top-k choice does: no expert gets more than one copy
of a token.

Examples:

  python tools/moe_balance_sim.py --synthetic zipf:1.2
  python tools/moe_balance_sim.py --synthetic hot:4:0.3 --experts 128 --ep 16 --spare 2 --ranks-per-node 8
  python tools/moe_balance_sim.py --trace runs/qwen3_moe/routing_trace.jsonl --ep 8 --spare 2 --window 20 --json balance.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
from loongforge.core.errors import UserError, os_error_message
from loongforge.core.parallel.expert_placement import home_placement, imbalance, plan_replication


def simulate(steps_loads: list[np.ndarray], ep: int, spare: int, ranks_per_node: int | None, window: int) -> dict:
    """Score the home layout and replication planned from the previous `window` steps on every
    step after the first `window`. Returns the mean and worst max/mean of each layout, and the
    mean number of replicas the plans used."""
    if window < 1:
        raise UserError(f"window must be at least 1, got {window}")
    if len(steps_loads) <= window:
        raise UserError(f"{len(steps_loads)} steps leave none to evaluate after a window of {window}")
    loads = np.asarray(steps_loads, dtype=np.float64)
    home = home_placement(loads.shape[1], ep, spare)
    plain, replicated, replicas = [], [], []
    for t in range(window, len(loads)):
        plan = plan_replication(loads[t - window : t].sum(axis=0), ep, spare, ranks_per_node)
        plain.append(imbalance(home.rank_loads(loads[t])))
        replicated.append(imbalance(plan.rank_loads(loads[t])))
        replicas.append(len(plan.replica_order))
    return {
        "steps_evaluated": len(plain),
        "plain_mean": float(np.mean(plain)),
        "plain_worst": float(np.max(plain)),
        "replicated_mean": float(np.mean(replicated)),
        "replicated_worst": float(np.max(replicated)),
        "replicas_mean": float(np.mean(replicas)),
    }


def initial_popularity(spec: str, experts: int, rng: np.random.Generator) -> np.ndarray:
    """[E] probabilities from a `zipf:S` or `hot:K:F` spec."""
    kind, _, params = spec.partition(":")
    values = params.split(":") if params else []
    if kind == "zipf" and len(values) == 1:
        exponent = _number(values[0], spec)
        if exponent < 0:
            raise UserError(f"bad --synthetic {spec!r}: the zipf exponent must be >= 0")
        weights = np.arange(1, experts + 1, dtype=np.float64) ** -exponent
        popularity = np.empty(experts)
        popularity[rng.permutation(experts)] = weights / weights.sum()
        return popularity
    if kind == "hot" and len(values) == 2:
        hot_count, hot_fraction = _number(values[0], spec), _number(values[1], spec)
        if hot_count != int(hot_count) or not 1 <= hot_count < experts or not 0 <= hot_fraction <= 1:
            raise UserError(f"bad --synthetic {spec!r}: hot:K:F needs 1 <= K < experts ({experts}) and 0 <= F <= 1")
        popularity = np.full(experts, (1 - hot_fraction) / (experts - int(hot_count)))
        popularity[rng.choice(experts, int(hot_count), replace=False)] = hot_fraction / hot_count
        return popularity
    raise UserError(f"bad --synthetic {spec!r}: expected zipf:S or hot:K:F")


def synthetic_steps(spec: str, experts: int, top_k: int, tokens: int, steps: int, drift: float, seed: int) -> list[np.ndarray]:
    """Per-step [E] token counts: each of `tokens` tokens routed to `top_k` distinct experts drawn
    without replacement in proportion to a slowly drifting popularity (Gumbel top-k)."""
    rng = np.random.default_rng(seed)
    popularity = initial_popularity(spec, experts, rng)
    loads = []
    with np.errstate(divide="ignore"):
        for _ in range(steps):
            if rng.random() < drift:
                i, j = rng.choice(experts, 2, replace=False)
                popularity[[i, j]] = popularity[[j, i]]
            scores = np.log(popularity) - np.log(-np.log(rng.random((tokens, experts))))
            chosen = np.argpartition(-scores, top_k - 1, axis=1)[:, :top_k]
            loads.append(np.bincount(chosen.ravel(), minlength=experts).astype(np.float64))
    return loads


def read_trace(path: Path) -> dict[int, list[np.ndarray]]:
    """Per layer, the token counts of its steps in step order."""
    if not path.is_file():
        raise UserError(f"trace file not found: {path}")
    by_layer: dict[int, dict[int, np.ndarray]] = {}
    with open(path) as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            step, layer, counts = _parse_record(line, f"{path} line {line_number}")
            layer_steps = by_layer.setdefault(layer, {})
            if step in layer_steps:
                raise UserError(f"{path} line {line_number}: step {step} of layer {layer} appears twice")
            first = next(iter(layer_steps.values()), counts)
            if len(counts) != len(first):
                raise UserError(f"{path} line {line_number}: {len(counts)} experts, earlier lines of layer {layer} have {len(first)}")
            layer_steps[step] = counts
    if not by_layer:
        raise UserError(f"trace file {path} holds no records")
    return {layer: [steps[s] for s in sorted(steps)] for layer, steps in sorted(by_layer.items())}


def _parse_record(line: str, where: str) -> tuple[int, int, np.ndarray]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(record, dict):
        raise UserError(f"{where}: expected an object with step, layer and tokens_per_expert")
    for key in ("step", "layer"):
        if not _is_int(record.get(key)):
            raise UserError(f"{where}: {key!r} must be an integer")
    counts = record.get("tokens_per_expert")
    if not isinstance(counts, list) or not counts or not all(_is_number(c) and math.isfinite(c) and c >= 0 for c in counts):
        raise UserError(f"{where}: 'tokens_per_expert' must be a non-empty list of non-negative numbers")
    return record["step"], record["layer"], np.asarray(counts, dtype=np.float64)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number(text: str, spec: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UserError(f"bad --synthetic {spec!r}: {text!r} is not a number") from None
    if not math.isfinite(value):
        raise UserError(f"bad --synthetic {spec!r}: {text!r} is not a finite number")
    return value


def format_table(rows: list[dict]) -> str:
    header = "| scenario | EP | spare | plain max/mean (mean) | plain max/mean (worst) | replicated max/mean (mean) | replicated max/mean (worst) |"
    lines = [header, "|" + "---|" * 7]
    for row in rows:
        numbers = (row["plain_mean"], row["plain_worst"], row["replicated_mean"], row["replicated_worst"])
        lines.append(f"| {row['scenario']} | {row['ep']} | {row['spare']} | " + " | ".join(f"{x:.3f}" for x in numbers) + " |")
    return "\n".join(lines)


def _mean_row(rows: list[dict]) -> dict:
    keys = ("plain_mean", "plain_worst", "replicated_mean", "replicated_worst", "replicas_mean")
    mean = {k: float(np.mean([row[k] for row in rows])) for k in keys}
    return {"scenario": f"mean over {len(rows)} layers", "ep": rows[0]["ep"], "spare": rows[0]["spare"], **mean}


def build_rows(args) -> list[dict]:
    layout = {"ep": args.ep, "spare": args.spare}
    if args.synthetic:
        steps = synthetic_steps(args.synthetic, args.experts, args.top_k, args.tokens, args.steps, args.drift, args.seed)
        result = simulate(steps, args.ep, args.spare, args.ranks_per_node, args.window)
        return [{"scenario": args.synthetic, **layout, **result}]
    rows = []
    for layer, steps in read_trace(Path(args.trace)).items():
        result = simulate(steps, args.ep, args.spare, args.ranks_per_node, args.window)
        rows.append({"scenario": f"{Path(args.trace).name} layer {layer}", **layout, **result})
    return rows + [_mean_row(rows)] if len(rows) > 1 else rows


def check_args(args) -> None:
    positive = {"--ep": args.ep, "--window": args.window, "--experts": args.experts, "--top-k": args.top_k, "--tokens": args.tokens}
    for flag, value in positive.items():
        if value < 1:
            raise UserError(f"{flag} must be at least 1, got {value}")
    if args.spare < 0:
        raise UserError(f"--spare must be >= 0, got {args.spare}")
    if args.ranks_per_node is not None and (args.ranks_per_node < 1 or args.ep % args.ranks_per_node):
        raise UserError(f"--ranks-per-node {args.ranks_per_node} must divide --ep {args.ep}")
    if not 0 <= args.drift <= 1:
        raise UserError(f"--drift must be a probability in [0, 1], got {args.drift}")
    if args.synthetic and args.experts % args.ep:
        raise UserError(f"--experts {args.experts} must be a multiple of --ep {args.ep}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", metavar="FILE", help="routing trace, JSON Lines of {step, layer, tokens_per_expert}")
    source.add_argument("--synthetic", metavar="SPEC", help="zipf:S or hot:K:F")
    parser.add_argument("--experts", type=int, default=64, help="synthetic: experts per layer (default 64)")
    parser.add_argument("--top-k", type=int, default=8, help="synthetic: experts per token (default 8)")
    parser.add_argument("--tokens", type=int, default=4096, help="synthetic: tokens per step (default 4096)")
    parser.add_argument("--steps", type=int, default=200, help="synthetic: steps (default 200)")
    parser.add_argument(
        "--drift", type=float, default=0.05, help="synthetic: per-step probability that two experts swap popularity (default 0.05)"
    )
    parser.add_argument("--seed", type=int, default=0, help="synthetic: random seed (default 0)")
    parser.add_argument("--ep", type=int, default=8, help="expert-parallel ranks (default 8)")
    parser.add_argument("--spare", type=int, default=2, help="spare expert slots per rank (default 2)")
    parser.add_argument("--ranks-per-node", type=int, default=None, help="consecutive ranks per node (default: all on one node)")
    parser.add_argument("--window", type=int, default=10, help="steps summed to plan the next step's replicas (default 10)")
    parser.add_argument("--json", metavar="OUT", help="also write the numbers to this JSON file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_args(args)
        rows = build_rows(args)
        print(f"window {args.window} steps, {rows[0]['steps_evaluated']} steps evaluated; max/mean tokens per EP rank (1.0 = balanced)\n")
        print(format_table(rows))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"config": vars(args), "rows": rows}, f, indent=1)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        message = os_error_message(e)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
