"""Run logs: `<run_dir>/metrics.jsonl` (one JSON object per logged step), TensorBoard event
files under `<run_dir>/tensorboard`, and a progress bar. Only rank 0 writes."""

from __future__ import annotations

import json
import math
from pathlib import Path

from loongforge.core.checkpoint.layout import write_durable
from tqdm import tqdm


def keep_until(path: Path, step: int) -> None:
    """Drop the rows of `path` (metrics.jsonl) logged after `step`, and a torn last line: what a
    run resumed at `step` (0: a fresh start) will log again. Rewritten atomically."""
    if not path.is_file():
        return
    kept, changed = [], False
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
            keep = isinstance(row, dict) and row.get("step", 0) <= step
        except ValueError:
            keep = False
        if keep:
            kept.append(line)
        else:
            changed = True
    if changed:
        write_durable(path, "".join(k + "\n" for k in kept))


class Metrics:
    def __init__(self, run_dir: Path, total: int, start: int, enabled: bool) -> None:
        self.enabled = enabled
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / "metrics.jsonl"
        keep_until(path, start)
        self.jsonl = open(path, "a")
        from torch.utils.tensorboard import SummaryWriter

        # steps after `start` that an interrupted run logged are hidden from TensorBoard, as
        # they are dropped from metrics.jsonl: a resumed run plots as one curve
        self.tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start + 1)
        self.bar = tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True, mininterval=1.0)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self.jsonl.write(json.dumps(clean) + "\n")
        self.jsonl.flush()
        step = record["step"]
        for k, v in record.items():
            if k != "step" and isinstance(v, (int, float)) and v is not None:
                self.tb.add_scalar(f"train/{k}" if not k.startswith("eval") else k.replace("_", "/", 1), v, step)
        post = {"loss": f"{record.get('loss', float('nan')):.4f}", "lr": f"{record.get('lr', 0):.2e}"}
        if "tokens_per_s" in record:
            post["tok/s"] = f"{record['tokens_per_s']:.0f}"
        if record.get("mfu") is not None:
            post["mfu"] = f"{100 * record['mfu']:.1f}%"
        mem = record.get("mem_peak_gib", record.get("rss_gib"))
        if mem is not None:
            post["mem"] = f"{mem:.1f}G"
        self.bar.set_postfix(post, refresh=False)

    def advance(self, n: int = 1) -> None:
        if self.enabled:
            self.bar.update(n)

    def write(self, text: str) -> None:
        if self.enabled:
            self.bar.write(text)

    def close(self) -> None:
        if self.enabled:
            self.bar.close()
            self.tb.close()
            self.jsonl.close()
