"""Pretraining end to end through the CLI: data tools, HF in and out, blends, logs, signals,
the NaN guard and activation recompute."""

import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from conftest import FAST, cli_env, losses, run_cli
from safetensors.torch import load_file

pytestmark = pytest.mark.slow


def test_preprocess_jsonl_and_parquet_roundtrip(tmp_path):
    import datasets
    from loongforge.core.data.text import load_tokenizer
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    docs = ["Ada found a red kite.", "one plus two is three.", "Ben sold the lamp at the market."]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    datasets.Dataset.from_dict({"text": docs}).to_parquet(str(tmp_path / "b.parquet"))
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "saved"))
    (arrow,) = (tmp_path / "saved").glob("*.arrow")
    tok = load_tokenizer("tiny")
    for src, prefix in (("a.jsonl", "ja"), ("b.parquet", "pq"), (arrow, "ar")):
        r = run_cli(
            [
                "preprocess",
                "--input",
                str(tmp_path / src),
                "--tokenizer",
                "tiny",
                "--output-prefix",
                str(tmp_path / prefix),
                "--workers",
                "2",
            ]
        )
        assert r.returncode == 0, r.stderr[-3000:]
        info = json.loads(r.stdout.strip().splitlines()[-1])
        ds = IndexedDataset(str(tmp_path / prefix))
        assert len(ds) == len(docs) == info["documents"]
        for i, d in enumerate(docs):
            want = tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            assert ds[i].tolist() == want
        assert info["tokens"] == sum(len(ds[i]) for i in range(len(ds)))


@pytest.fixture(scope="module")
def tiny_prefixes(tmp_path_factory):
    from loongforge.core.data.text import load_tokenizer
    from loongforge.llm.data import preprocess
    from loongforge.llm.pretrain import resolve_corpus

    d = tmp_path_factory.mktemp("data")
    lines = resolve_corpus("tiny").read_text().splitlines()
    (d / "a.jsonl").write_text("\n".join(lines[:2000]) + "\n")
    (d / "b.jsonl").write_text("\n".join(lines[2000:]) + "\n")
    tok = load_tokenizer("tiny")
    return [preprocess([str(d / f"{n}.jsonl")], tok, str(d / n))["prefix"] for n in "ab"]


def test_blended_datasets_with_weights_and_validation(tiny_prefixes, tmp_path):
    a, b = tiny_prefixes
    r = run_cli(
        [
            "train",
            "tiny",
            *FAST,
            "train.train_iters=6",
            "train.eval_interval=3",
            f"data.data_path=[0.7,{a},0.3,{b}]",
            "data.split='90,10,0'",
            f"checkpoint.run_dir={tmp_path}",
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows] == [1, 2, 3, 4, 5, 6]
    for x in rows:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s"} <= set(x)
        assert x["tokens_per_s"] > 0 and np.isfinite(x["grad_norm"])
    assert rows[2]["eval_loss"] > 0 and rows[5]["eval_loss"] > 0
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    cache = list((tmp_path / "data").glob("cache-*/**/*.npy"))  # keyed by the data files' identity
    assert cache, "megatron's blend/sample index cache was built"


def test_start_from_hf_and_export_back(hf_llama4, tmp_path):
    """lr=0 and no weight decay: the exported HF weights are the imported ones, bit for bit."""
    r = run_cli(
        [
            "train",
            "tiny",
            *FAST,
            "train.train_iters=2",
            "train.lr=0",
            "train.min_lr=0",
            "train.weight_decay=0",
            f"checkpoint.load={hf_llama4}",
            "checkpoint.export_hf=true",
            f"checkpoint.run_dir={tmp_path}",
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = load_file(str(hf_llama4 / "model.safetensors")), load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "hf" / "tokenizer.json").is_file()


def test_first_step_loss_equals_hf_loss(hf_llama4, tmp_path):
    """The step-1 loss of a run started from HF weights is HF's loss on the same batch."""
    import transformers

    r = run_cli(
        [
            "train",
            "tiny",
            *FAST,
            "train.train_iters=1",
            "data.split='95,5,0'",
            f"checkpoint.load={hf_llama4}",
            f"checkpoint.run_dir={tmp_path}",
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    from loongforge.core.data.text import load_tokenizer
    from loongforge.llm.config import TextDataConfig
    from loongforge.llm.data import build_gpt_datasets

    (idx,) = (tmp_path / "data").glob("corpus-*/corpus_text_document.idx")  # the run's corpus cache
    cfg = TextDataConfig(data_path=[str(idx.with_suffix(""))], seq_length=32, split="95,5,0")
    train, _, _ = build_gpt_datasets(cfg, load_tokenizer("tiny"), 1234, [4, 1, 0], tmp_path / "test_cache")
    tokens = torch.stack([train[i]["tokens"] for i in range(4)])
    labels = torch.stack([train[i]["labels"] for i in range(4)])
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_llama4)).eval()
    with torch.no_grad():
        logits = hf(tokens).logits
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)).item()
    assert abs(losses(tmp_path)[1] - want) < 1e-5 * want


def test_sigterm_saves_and_the_rerun_resumes(hf_llama4, tmp_path):
    args = [
        "train",
        "tiny",
        *FAST,
        "train.train_iters=400",
        "train.micro_batch_size=8",
        "train.global_batch_size=64",
        "data.seq_length=128",
        f"checkpoint.load={hf_llama4}",
        f"checkpoint.run_dir={tmp_path}",
    ]
    p = subprocess.Popen(
        [sys.executable, "-m", "loongforge.llm.cli", *args], env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 300
    while (not metrics.exists() or len(metrics.read_text().splitlines()) < 2) and time.time() < deadline:
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGTERM, err[-3000:]
    saved = int((tmp_path / "checkpoints" / "latest").read_text().removeprefix("step_"))
    assert saved >= 2 and saved == max(losses(tmp_path))
    r = run_cli(args + ["train.train_iters=" + str(saved + 1)])
    assert f"at step {saved}" in r.stdout, r.stderr[-3000:]


def test_nan_guard_skips_then_stops(tmp_path):
    r = run_cli(
        [
            "train",
            "tiny",
            *FAST,
            "train.train_iters=20",
            "train.lr=1e30",
            "train.lr_warmup_iters=0",
            "train.clip_grad=0",
            "train.max_bad_steps=2",
            f"checkpoint.run_dir={tmp_path}",
        ]
    )
    assert r.returncode == 2, r.stderr[-3000:]
    assert "consecutive steps with NaN/Inf" in r.stderr.strip().splitlines()[-1]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any(x["skipped"] for x in rows)


def test_recompute_gives_the_same_losses(hf_llama4, tmp_path):
    runs = {}
    for flag in ("false", "true"):
        d = tmp_path / flag
        r = run_cli(
            [
                "train",
                "tiny",
                *FAST,
                "train.train_iters=3",
                f"train.recompute={flag}",
                f"checkpoint.load={hf_llama4}",
                f"checkpoint.run_dir={d}",
            ]
        )
        assert r.returncode == 0, r.stderr[-3000:]
        runs[flag] = losses(d)
    for step, loss in runs["false"].items():
        assert abs(runs["true"][step] - loss) <= 1e-6 * loss


def test_demo_as_in_the_readme(tmp_path):
    """`loongforge-llm train tiny`: the README's demo, unchanged but for the run directory."""
    import transformers

    t0 = time.time()
    r = run_cli(["train", "tiny", f"checkpoint.run_dir={tmp_path}"])
    took = time.time() - t0
    assert r.returncode == 0, r.stderr[-3000:]
    curve = losses(tmp_path)
    first, last = curve[min(curve)], curve[max(curve)]
    assert max(curve) == 150 and last < 0.3 * first, (first, last)
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_00000150"
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    ids = tok("three plus two is", return_tensors="pt").input_ids
    text = tok.decode(hf.generate(ids, max_new_tokens=3, do_sample=False)[0])
    assert text.startswith("three plus two is five"), text
    print(f"demo took {took:.0f}s")
