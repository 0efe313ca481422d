"""This tree's LLM step time against another source tree's (for example a `git archive` of an
earlier commit), on one GPU: each measurement is one `llm_throughput.py --setups SETUP` run in a
fresh process, the two trees alternating (this, other, this, other, ...) for `--rounds` rounds,
so that clock drift and warm-up order fall on both alike. Prints every round's ms/step and the
median of each tree last.

    git archive 1eb0abf packages tools/benchmarks | tar -x -C /tmp/old
    python tools/benchmarks/compare_trees.py --other /tmp/old --setups "loongforge trainer (pure bf16),loongforge trainer"

Each tree's packages are imported from its `packages/*/src` (the rest of PYTHONPATH is kept), and
its own `tools/benchmarks/llm_throughput.py` times the setup, so a setup name must exist in both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[2]


def run_once(tree: Path, setup: str, extra: list[str]) -> float:
    src = [str(p) for p in sorted((tree / "packages").glob("*/src"))]
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and "/packages/" not in p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(kept[:1] + src + kept[1:])}
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, str(tree / "tools/benchmarks/llm_throughput.py"), "--setups", setup, "--json", f.name, *extra]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{tree}: {setup!r} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
        return json.load(open(f.name))["results"][setup]["ms_per_step"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--other", type=Path, required=True, help="the other source tree (packages/*/src, tools/benchmarks)")
    p.add_argument("--setups", required=True, help="comma-separated llm_throughput.py setup names")
    p.add_argument("--rounds", type=int, default=3)
    a, extra = p.parse_known_args()  # the rest goes to llm_throughput.py (--steps, --warmup, shape)
    if not (a.other / "tools/benchmarks/llm_throughput.py").is_file():
        raise SystemExit(f"--other {a.other}: no tools/benchmarks/llm_throughput.py there; pass a source tree of this repository")
    trees = {"this": HERE, "other": a.other.resolve()}
    times: dict[tuple[str, str], list[float]] = {}
    for r in range(a.rounds):
        for setup in [s.strip() for s in a.setups.split(",")]:
            for label, tree in trees.items():
                ms = run_once(tree, setup, extra)
                times.setdefault((setup, label), []).append(ms)
                print(f"round {r + 1}, {label} tree, {setup}: {ms:.1f} ms/step", flush=True)
    print("\n| setup | this tree ms/step | other tree ms/step | median difference |\n| --- | --- | --- | --- |")
    for setup in dict.fromkeys(s for s, _ in times):
        this, other = times[(setup, "this")], times[(setup, "other")]
        diff = statistics.median(this) / statistics.median(other) - 1
        fmt = lambda xs: ", ".join(f"{x:.1f}" for x in xs)  # noqa: E731
        print(f"| {setup} | {fmt(this)} | {fmt(other)} | {100 * diff:+.1f}% |")


if __name__ == "__main__":
    main()
