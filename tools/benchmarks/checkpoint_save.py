"""What a durable checkpoint costs: `Trainer.save` of the 1.3B config (megatron stack, fp32
masters: weights and AdamW moments, fp32 on disk) with the commit's fsyncs (every file and
directory of the step, the manifest, the rename, `latest`) and with them turned off, alternating,
in one process. megatron-core's writer fsyncs the shard files it writes either way; the
difference is what the commit's own ordering adds.

    python tools/benchmarks/checkpoint_save.py --run-dir /tmp/ckpt_bench    # on the GPU machine
    python tools/benchmarks/checkpoint_save.py --layers 2 --rounds 1        # a quick smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from llm_throughput import add_model_args, loongforge_trainer, model_config  # noqa: E402


@contextlib.contextmanager
def timed_fsyncs(enabled: bool, spent: list):
    """The commit's fsyncs as they are (timed) or turned off (benchmark only)."""
    from loongforge.core.checkpoint import layout

    orig = layout.fsync_path

    def fsync_path(p):
        if enabled:
            t = time.perf_counter()
            orig(p)
            spent.append(time.perf_counter() - t)

    layout.fsync_path = fsync_path
    try:
        yield
    finally:
        layout.fsync_path = orig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--run-dir", default="/tmp/loongforge_ckpt_bench")
    a = p.parse_args()
    logging.getLogger("megatron").setLevel(logging.ERROR)
    mcfg = model_config(a, a.seq)
    run_dir = Path(a.run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    trainer = loongforge_trainer(mcfg, a.micro_batch, a.seq, "masters", kernels=True)
    trainer.run_dir = run_dir
    trainer.ckpt_cfg.run_dir = str(run_dir)
    trainer.ckpt_cfg.keep_last = 1
    tokens = torch.randint(0, a.vocab, (a.micro_batch, a.seq), device="cuda")
    mb = {"tokens": tokens, "labels": tokens.roll(-1, 1), "loss_weights": torch.ones(tokens.shape, device="cuda")}
    trainer.train_step([mb])  # the AdamW moments exist
    rows = []
    for r in range(a.rounds):
        for durable in (True, False):
            trainer.train_step([mb])  # a new step number: every save writes a new step directory
            torch.cuda.synchronize()
            spent: list = []
            t = time.perf_counter()
            with timed_fsyncs(durable, spent):
                step_dir = trainer.save()
            total = time.perf_counter() - t
            size = sum(f.stat().st_size for f in step_dir.rglob("*") if f.is_file()) / 2**30
            rows.append((r + 1, durable, total, sum(spent), len(spent), size))
            print(
                f"round {r + 1}, fsyncs {'on' if durable else 'off'}: save {total:.2f} s, in fsync {sum(spent):.2f} s ({len(spent)} calls), {size:.1f} GiB",
                flush=True,
            )
    print("\n| round | commit fsyncs | save s | of which fsync s | fsync calls | GiB |\n| --- | --- | --- | --- | --- | --- |")
    for r, durable, total, fs, n, size in rows:
        print(f"| {r} | {'on' if durable else 'off'} | {total:.2f} | {fs:.2f} | {n} | {size:.1f} |")
    on = [t for _, d, t, *_ in rows if d]
    off = [t for _, d, t, *_ in rows if not d]
    print(f"mean save: {sum(on) / len(on):.2f} s with the commit's fsyncs, {sum(off) / len(off):.2f} s without")
    shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
