"""Record a MoE model's routing on real text: how many tokens each layer's router sends to each
expert, per step, in the JSON Lines format `tools/moe_balance_sim.py --trace` reads:

    {"step": 0, "layer": 1, "tokens_per_expert": [310.0, 12.0, ...]}

Examples:

    python tools/record_routing_trace.py runs/tiny-moe --text corpus.jsonl --out trace.jsonl
    python tools/record_routing_trace.py /models/Qwen3-30B-A3B --tokenizer /models/Qwen3-30B-A3B \\
        --text data.jsonl --tokens-per-step 16384 --seq-length 4096 --steps 100 --out qwen3_trace.jsonl

The model (an HF directory of a MoE family or a LoongForge checkpoint) runs forward on the CPU in
fp32, `--tokens-per-step` tokens a step (`--seq-length` tokens a row) from the text, documents
joined by the tokenizer's end-of-text token; the text file is JSON Lines with a "text" field, or
plain text (one document a line). Layer numbers count from 0, as HF names layers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="HF directory or LoongForge run / checkpoint of a MoE model")
    p.add_argument(
        "--tokenizer", default=None, help="HF tokenizer directory or 'tiny' (default: the run's own tokenizer/, else the model directory)"
    )
    p.add_argument("--text", required=True, help="JSON Lines with a 'text' field, or plain text")
    p.add_argument("--out", required=True, help="trace file to write (must not exist)")
    p.add_argument("--tokens-per-step", type=int, default=4096)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--steps", type=int, default=50)
    return p.parse_args(argv)


def documents(path: Path):
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            if line.startswith("{"):
                try:
                    text = json.loads(line).get("text")
                except ValueError:
                    text = line
            else:
                text = line
            if isinstance(text, str) and text:
                yield text


def token_stream(tok, path: Path):
    """The documents' tokens, end-of-text between documents, cycling through the file."""
    from loongforge.core.data.text.tokenizer import eod_id
    from loongforge.core.errors import UserError

    eod = eod_id(tok)
    while True:
        n = 0
        for text in documents(path):
            ids = tok(text, add_special_tokens=False)["input_ids"]
            n += len(ids)
            yield from ids
            yield eod
        if n == 0:
            raise UserError(f"{path}: no text found")


def main(argv: list[str]) -> int:
    import torch
    from loongforge.core.data.text import load_tokenizer
    from loongforge.core.errors import UserError
    from loongforge.core.foundation.moe import routers
    from loongforge.llm import load_model

    a = parse(argv)
    text, out = Path(a.text), Path(a.out)
    if not text.is_file():
        raise UserError(f"--text {text}: file not found")
    if out.exists():
        raise UserError(f"--out {out} exists; choose a new file (nothing was written)")
    if a.tokens_per_step < a.seq_length or a.tokens_per_step % a.seq_length:
        raise UserError(f"--tokens-per-step={a.tokens_per_step} must be a multiple of --seq-length={a.seq_length}")
    model = load_model(a.model)
    found = routers(model.gpt)
    if not found:
        raise UserError(f"{a.model}: not a mixture-of-experts model (no router)")
    tok_path = a.tokenizer or (str(Path(a.model) / "tokenizer") if (Path(a.model) / "tokenizer").is_dir() else str(a.model))
    tok = load_tokenizer(tok_path)
    stream = token_stream(tok, text)
    rows = a.tokens_per_step // a.seq_length
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w") as f, torch.no_grad():
        for step in range(a.steps):
            ids = torch.tensor([next(stream) for _ in range(a.tokens_per_step)]).view(rows, a.seq_length)
            model(ids)
            for r in found:
                counts = r.stats["tokens_per_expert"].tolist()
                f.write(json.dumps({"step": step, "layer": r.layer_number - 1, "tokens_per_expert": counts}) + "\n")
            print(f"step {step + 1}/{a.steps}", end="\r", file=sys.stderr, flush=True)
    tmp.rename(out)
    print(f"\nwrote {a.steps} steps x {len(found)} layers to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from loongforge.core.errors import cli_entry

    sys.exit(cli_entry(main)())
