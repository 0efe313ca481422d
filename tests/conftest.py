"""Shared test helpers: tiny HF models as oracles, and running the real CLIs in subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loongforge.core.parallel import free_port


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


HF_CLASSES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}


def make_hf_model(family: str, out: Path, seed: int = 0, **overrides):
    """A tiny random HF model saved with `save_pretrained`; returns the HF module (eval)."""
    import transformers

    kw = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=176, vocab_size=512, max_position_embeddings=256)
    kw.update(overrides)
    torch.manual_seed(seed)
    cfg = getattr(transformers, HF_CLASSES[family])(**kw)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(str(out))
    return model


def cli_env() -> dict:
    env = dict(os.environ)
    env.setdefault("LOONGFORGE_DEVICE", "cpu")
    env["PYTHONWARNINGS"] = "ignore"
    return env


def run_cli(args: list[str], nproc: int = 1, cwd: Path | None = None, timeout: int = 600, module: str = "loongforge.llm.cli") -> subprocess.CompletedProcess:
    """Run a CLI as a user would: `python -m ...` for one process, torchrun for several."""
    if nproc == 1:
        cmd = [sys.executable, "-m", module, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(free_port()), "-m", module, *args]
    return subprocess.run(cmd, cwd=cwd, env=cli_env(), capture_output=True, text=True, timeout=timeout)


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


# A small, fast training config (4-layer Llama from HF weights, seq 32) shared by the LLM tests.
FAST = [
    "train.eval_interval=0",
    "train.log_interval=1",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.lr_warmup_iters=2",
    "data.seq_length=32",
    "checkpoint.export_hf=false",
]


@pytest.fixture(scope="session")
def hf_llama4(tmp_path_factory) -> Path:
    """A 4-layer tiny HF Llama over the shipped tokenizer's vocabulary (512)."""
    d = tmp_path_factory.mktemp("hf_llama4")
    make_hf_model("llama", d, num_hidden_layers=4)
    return d


# Six alpaca rows of the tiny tokenizer's vocabulary, for the SFT and LoRA tests.
SFT_ROWS = [
    {"instruction": "What is one plus two?", "output": "one plus two is three."},
    {"instruction": "Ada gave the kite to Ben. Who has the kite?", "output": "Ben has the kite."},
    {"instruction": "What is four plus one?", "input": "count on your fingers", "output": "four plus one is five."},
    {"instruction": "What is zero plus zero?", "output": "zero."},
    {"instruction": "Cleo gave the lamp to Dev. Who has the lamp?", "output": "Dev has the lamp, since Cleo gave it away."},
    {"instruction": "What is two plus two?", "output": "two plus two is four."},
]


@pytest.fixture(scope="session")
def rows_file(tmp_path_factory) -> Path:
    f = tmp_path_factory.mktemp("sft_rows") / "rows.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in SFT_ROWS))
    return f
