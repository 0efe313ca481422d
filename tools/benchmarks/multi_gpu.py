"""Multi-GPU validation in one call (issue: multi-GPU runs): loss curves of TP/PP/DP layouts
against one GPU, a checkpoint resumed at another layout, and tokens/s per GPU.

    python tools/benchmarks/multi_gpu.py --gpus 2                      # TP=2, PP=2, DP=2
    python tools/benchmarks/multi_gpu.py --gpus 4                      # TP2xPP2, TP2xDP2, DP4
    python tools/benchmarks/multi_gpu.py --gpus 8 --global-batch 32    # TP2xDP4, TP2xPP2xDP2, DP8
    python tools/benchmarks/multi_gpu.py --gpus 8 --layouts 1x1,2x1,2x2,4x1,8x1   # other (TP x PP) layouts
    LOONGFORGE_DEVICE=cpu python tools/benchmarks/multi_gpu.py --gpus 2 --config tiny --steps 6 \\
        --global-batch 8 --micro-batch 2 --set data.seq_length=64   # a smoke run on CPU (gloo)

Every run trains `--config` (default llama_1p3b, the shipped 1.3B config and corpus) from the same
weights (a step-0 HF export made first: a fresh initialization differs between pipeline layouts,
as in megatron, since each stage draws only its own layers) with the same global batch, so every
layout must give the one-GPU loss curve up to rounding. The bound: per step, |loss(layout) -
loss(1 GPU)| <= 2 x the largest per-step difference between two one-GPU runs that differ only in
how the same global batch is split into micro-batches (--micro-batch and half of it). Both are
valid runs of the same training; they differ by bf16 rounding in other summation orders, which is
what a TP/PP/DP layout changes too (the factor 2 leaves room for a layout stirring that noise a
little more than one split does); never below 1e-5 of the loss (fp32 summation-order noise, the
bound of the CPU layout tests). The resume check trains the first layout to the
middle with a checkpoint, resumes that checkpoint at the second layout and requires the same bound
against the uninterrupted one-GPU curve. tokens/s per GPU is the median over the second half of
each run's steps. Logs and a JSON summary land in --out; the exit code is 1 when a layout or the
resume falls outside the bound. On one H200-class GPU a 50-step 1.3B run with global batch 16
takes about 30 s of steps plus start-up; `--gpus 2` runs 7 trainings.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
from pathlib import Path

# (TP, PP) per GPU count, DP is what remains: the layouts the multi-GPU issue names, plus pure DP
DEFAULT_LAYOUTS = {2: [(2, 1), (1, 2), (1, 1)], 4: [(2, 2), (2, 1), (1, 1)], 8: [(2, 1), (2, 2), (1, 1)]}


def parse_layouts(text: str | None, gpus: int) -> list[tuple[int, int]]:
    if not text:
        return DEFAULT_LAYOUTS.get(gpus, [(1, 1)])
    out = []
    for item in text.split(","):
        tp, pp = (int(x) for x in item.lower().split("x"))
        if gpus % (tp * pp):
            raise SystemExit(f"--layouts {item}: TP x PP = {tp * pp} does not divide --gpus {gpus}")
        out.append((tp, pp))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(a, name: str, nproc: int, extra: list[str]) -> Path:
    run_dir = Path(a.out) / name
    args = [
        "train",
        a.config,
        f"train.train_iters={a.steps}",
        f"train.global_batch_size={a.global_batch}",
        f"train.micro_batch_size={a.micro_batch}",
        "train.log_interval=1",
        "train.eval_interval=0",
        "checkpoint.export_hf=false",
        f"checkpoint.run_dir={run_dir}",
        *a.set,
        *extra,
    ]
    if nproc == 1:
        cmd = [sys.executable, "-m", "loongforge.llm.cli", *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            "--master-port",
            str(free_port()),
            "-m",
            "loongforge.llm.cli",
            *args,
        ]
    print(f"[{name}] {' '.join(cmd[2:])}", flush=True)
    with open(Path(a.out) / f"{name}.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONWARNINGS="ignore")).returncode
    if rc != 0:
        raise SystemExit(f"[{name}] failed with exit code {rc}; see {Path(a.out) / f'{name}.log'}")
    return run_dir


def metrics(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows}


def losses(run_dir: Path) -> dict[int, float]:
    return {s: r["loss"] for s, r in metrics(run_dir).items()}


def per_gpu_tokens(run_dir: Path, steps: int, gpus: int) -> float:
    m = metrics(run_dir)
    return statistics.median(m[s]["tokens_per_s"] for s in range(steps // 2 + 1, steps + 1)) / gpus


def rewind(src: Path, dst: Path, step: int) -> None:
    """A copy of run `src` whose newest checkpoint is `step` (later ones left out)."""
    shutil.copytree(src, dst)
    ck = dst / "checkpoints"
    for d in ck.iterdir():
        if d.is_dir() and d.name.startswith("step_") and int(d.name.split("_")[1]) > step:
            shutil.rmtree(d)
    (ck / "latest").write_text(f"step_{step:08d}")
    metrics_file = dst / "metrics.jsonl"
    kept = [line for line in metrics_file.read_text().splitlines() if json.loads(line)["step"] <= step]
    metrics_file.write_text("".join(line + "\n" for line in kept))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, required=True, help="processes per layout (GPUs of this host)")
    p.add_argument("--config", default="llama_1p3b")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--layouts", default=None, help="comma-separated TPxPP, e.g. 2x1,1x2 (default: the issue's layouts for --gpus)")
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--set", nargs="*", default=[], help="extra config overrides for every run")
    p.add_argument("--out", default="runs/multi_gpu")
    a = p.parse_args()
    if a.steps < 4 or a.steps % 2:
        p.error("--steps must be even and at least 4 (the resume check starts at the middle)")
    if Path(a.out).exists():
        p.error(f"--out {a.out} exists; pass a new directory (nothing is overwritten)")
    Path(a.out).mkdir(parents=True)
    half = a.steps // 2

    if a.micro_batch < 2 or a.micro_batch % 2:
        p.error("--micro-batch must be even: the noise bound compares it with half of it")
    # one step at learning rate 0: the exported weights are the initialization every layout starts from
    init = train(a, "init", 1, ["train.train_iters=1", "train.lr=0", "train.min_lr=0", "checkpoint.export_hf=true"]) / "hf"
    a.set = [*a.set, f"checkpoint.load={init}"]
    single = train(a, "gpu1", 1, [f"train.save_interval={half}"])
    resplit = train(a, "gpu1_half_micro", 1, [f"train.micro_batch_size={a.micro_batch // 2}"])
    ref, other = losses(single), losses(resplit)
    bound = max(2 * max(abs(ref[s] - other[s]) for s in ref), 1e-5 * max(ref.values()))
    print(
        f"bound (2 x max |difference| between micro-batch {a.micro_batch} and {a.micro_batch // 2} on one GPU, "
        f"at least 1e-5 of the loss): {bound:.6f}",
        flush=True,
    )

    results = {"gpu1": {"tp": 1, "pp": 1, "dp": 1, "max_diff": 0.0, "tokens_per_gpu": per_gpu_tokens(single, a.steps, 1)}}
    runs = {}
    for tp, pp in parse_layouts(a.layouts, a.gpus):
        dp = a.gpus // (tp * pp)
        if a.global_batch % (dp * a.micro_batch):
            print(f"skipping TP{tp} PP{pp} DP{dp}: global batch {a.global_batch} is not a multiple of DP x micro-batch", flush=True)
            continue
        name = f"tp{tp}_pp{pp}_dp{dp}"
        d = train(
            a,
            name,
            a.gpus,
            [f"parallel.tensor_model_parallel_size={tp}", f"parallel.pipeline_model_parallel_size={pp}", f"train.save_interval={half}"],
        )
        got = losses(d)
        results[name] = {
            "tp": tp,
            "pp": pp,
            "dp": dp,
            "max_diff": max(abs(got[s] - ref[s]) for s in ref),
            "tokens_per_gpu": per_gpu_tokens(d, a.steps, a.gpus),
        }
        runs[name] = (tp, pp, d)

    resume = None
    names = list(runs)
    if len(names) >= 2:  # the first layout's mid-run checkpoint, continued at the second layout
        _, _, d_a = runs[names[0]]
        tp_b, pp_b, _ = runs[names[1]]
        name = f"resume_{names[0]}_to_{names[1]}"
        rewind(d_a, Path(a.out) / name, half)
        d = train(a, name, a.gpus, [f"parallel.tensor_model_parallel_size={tp_b}", f"parallel.pipeline_model_parallel_size={pp_b}"])
        if "resumed from" not in (Path(a.out) / f"{name}.log").read_text():
            raise SystemExit(f"[{name}] did not resume from the step-{half} checkpoint; see {Path(a.out) / f'{name}.log'}")
        got = losses(d)
        resume = {
            "from": names[0],
            "to": names[1],
            "at_step": half,
            "max_diff": max(abs(got[s] - ref[s]) for s in range(half + 1, a.steps + 1)),
        }

    base = results["gpu1"]["tokens_per_gpu"]
    print(f"\n{a.config}, global batch {a.global_batch}, micro-batch {a.micro_batch}, {a.steps} steps; bound {bound:.6f}\n")
    print("| layout | TP | PP | DP | max abs loss diff vs 1 GPU | within bound | tokens/s per GPU | efficiency vs 1 GPU |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    ok = True
    for name, r in results.items():
        within = r["max_diff"] <= bound
        ok &= within
        print(
            f"| {name} | {r['tp']} | {r['pp']} | {r['dp']} | {r['max_diff']:.6f} | {'yes' if within else 'NO'} | "
            f"{r['tokens_per_gpu']:,.0f} | {r['tokens_per_gpu'] / base:.2f} |"
        )
    if resume is not None:
        within = resume["max_diff"] <= bound
        ok &= within
        print(
            f"\nresume: {resume['from']} checkpoint at step {resume['at_step']} continued as {resume['to']}: "
            f"max abs loss diff vs 1 GPU over steps {half + 1}-{a.steps} {resume['max_diff']:.6f} ({'within' if within else 'OUTSIDE'} the bound)"
        )
    (Path(a.out) / "summary.json").write_text(json.dumps({"bound": bound, "layouts": results, "resume": resume, "args": vars(a)}, indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
