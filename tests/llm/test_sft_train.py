"""SFT through the CLI: packed training equals unpacked training on the same samples, across
layouts too; bad rows are counted; an all-masked dataset is an error."""

import json

import pytest
from conftest import SFT_ROWS as ROWS
from conftest import losses, run_cli

pytestmark = pytest.mark.slow

COMMON = [
    "train.lr_warmup_iters=0",
    "train.lr=5e-3",
    "train.min_lr=5e-3",
    "train.log_interval=1",
    "checkpoint.export_hf=false",
    "data.seq_length=256",
]


def _num_packs(rows_file):
    from loongforge.core.data import best_fit_decreasing
    from loongforge.core.data.text import SFTTokenizer, load_tokenizer, to_messages

    st = SFTTokenizer(load_tokenizer("tiny"), "llama3")
    lengths = [len(st(to_messages(r, "alpaca"))["input_ids"]) - 1 for r in ROWS]
    return len(best_fit_decreasing(lengths, 256))


def _sft(rows_file, run_dir, hf, *extra, nproc=1):
    """Every run starts from the same HF weights (random init depends on the pipeline layout)."""
    return run_cli(
        [
            "train",
            "sft",
            *COMMON,
            f"data.datasets=[{{path: {rows_file}, format: alpaca}}]",
            f"checkpoint.load={hf}",
            f"checkpoint.run_dir={run_dir}",
            *extra,
        ],
        nproc=nproc,
    )


@pytest.fixture(scope="module")
def packed(rows_file, hf_llama4, tmp_path_factory):
    d = tmp_path_factory.mktemp("packed")
    n = _num_packs(rows_file)
    assert n < len(ROWS)
    r = _sft(
        rows_file, d, hf_llama4, "data.packing=true", "train.micro_batch_size=1", f"train.global_batch_size={n}", "train.train_iters=3"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "packing efficiency" in r.stdout
    return losses(d)


def test_packed_equals_unpacked(packed, rows_file, hf_llama4, tmp_path):
    # every step's global batch is all six samples, packed or one per row
    r = _sft(
        rows_file,
        tmp_path,
        hf_llama4,
        "data.packing=false",
        "train.micro_batch_size=2",
        f"train.global_batch_size={len(ROWS)}",
        "train.train_iters=3",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    unpacked = losses(tmp_path)
    assert packed[3] < packed[1]
    for step in (1, 2, 3):
        assert abs(packed[step] - unpacked[step]) <= 1e-5 * unpacked[step], (step, packed[step], unpacked[step])


@pytest.mark.parametrize("layout", ["parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2"])
def test_packed_sft_across_layouts(layout, packed, rows_file, hf_llama4, tmp_path):
    n = _num_packs(rows_file)
    r = _sft(
        rows_file,
        tmp_path,
        hf_llama4,
        "data.packing=true",
        "train.micro_batch_size=1",
        f"train.global_batch_size={n}",
        "train.train_iters=3",
        layout,
        nproc=2,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = losses(tmp_path)
    for step in (1, 2, 3):
        assert abs(got[step] - packed[step]) <= 1e-5 * packed[step], (layout, step, got[step], packed[step])


def test_bad_rows_are_counted_and_all_masked_is_an_error(rows_file, tmp_path):
    f = tmp_path / "mixed.jsonl"
    f.write_text(rows_file.read_text() + json.dumps({"instruction": "no answer"}) + "\n")
    r = run_cli(
        [
            "train",
            "sft",
            *COMMON,
            f"data.datasets=[{{path: {f}, format: alpaca}}]",
            "train.global_batch_size=1",
            "train.train_iters=1",
            f"checkpoint.run_dir={tmp_path / 'a'}",
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "'missing_field': 1" in r.stdout and "'kept': 6" in r.stdout
    r = run_cli(
        [
            "train",
            "sft",
            *COMMON,
            f"data.datasets=[{{path: {f}, format: alpaca}}]",
            "data.on_bad_sample=error",
            f"checkpoint.run_dir={tmp_path / 'b'}",
        ]
    )
    assert r.returncode == 2 and "row 6: missing_field" in r.stderr
    # the same checks in process (the CLI's one line and exit 2 are above)
    from loongforge.core.data.text import load_tokenizer, tokenized_samples
    from loongforge.core.errors import UserError
    from loongforge.core.recipes import resolve
    from loongforge.llm.sft.recipe import sft_data

    g = tmp_path / "none.jsonl"
    g.write_text(json.dumps({"instruction": "x"}) + "\n")
    _, cfg = resolve("sft", [*COMMON, f"data.datasets=[{{path: {g}, format: alpaca}}]"], prefer="llm")
    with pytest.raises(UserError, match="all labels masked"):
        tokenized_samples(cfg.data, load_tokenizer(cfg.data.tokenizer), cfg.train.seed)
    _, cfg = resolve("sft", [*COMMON, "train.micro_batch_size=2"], prefer="llm")
    with pytest.raises(UserError, match="set train.micro_batch_size=1"):
        sft_data(cfg, None, 0, 1, tmp_path / "d", "cpu")


def test_prepacked_equals_in_memory(packed, rows_file, hf_llama4, tmp_path):
    out = tmp_path / "packed_data"
    r = run_cli(
        [
            "preprocess",
            "--sft",
            "--input",
            str(rows_file),
            "--format",
            "alpaca",
            "--tokenizer",
            "tiny",
            "--template",
            "llama3",
            "--seq-length",
            "256",
            "--output-dir",
            str(out),
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    info = json.loads(r.stdout.strip().splitlines()[-1])
    n = _num_packs(rows_file)
    assert info["samples"] == len(ROWS) and info["packs"] == n and 0 < info["packing_efficiency"] <= 1
    run = tmp_path / "run"
    r = _sft(
        rows_file,
        run,
        hf_llama4,
        f"data.prepacked={out}",
        "data.datasets=[]",
        "train.micro_batch_size=1",
        f"train.global_batch_size={n}",
        "train.train_iters=3",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = losses(run)
    for step in (1, 2, 3):
        assert abs(got[step] - packed[step]) <= 1e-6 * packed[step], (step, got[step], packed[step])
    # the prepacked directory is for one seq_length; an existing output directory is never overwritten
    r = _sft(rows_file, tmp_path / "r2", hf_llama4, f"data.prepacked={out}", "data.seq_length=64")
    assert r.returncode == 2 and "packed for seq_length=256" in r.stderr
    before = sorted(p.name for p in out.iterdir())
    r = run_cli(["preprocess", "--sft", "--input", str(rows_file), "--tokenizer", "tiny", "--template", "llama3", "--output-dir", str(out)])
    assert r.returncode == 2 and "not empty" in r.stderr and sorted(p.name for p in out.iterdir()) == before


def test_sample_normalization_packed_equals_unpacked(packed, rows_file, hf_llama4, tmp_path):
    n = _num_packs(rows_file)
    a = _sft(
        rows_file,
        tmp_path / "a",
        hf_llama4,
        "data.loss_normalization=sample",
        "data.packing=true",
        "train.micro_batch_size=1",
        f"train.global_batch_size={n}",
        "train.train_iters=2",
    )
    b = _sft(
        rows_file,
        tmp_path / "b",
        hf_llama4,
        "data.loss_normalization=sample",
        "data.packing=false",
        "train.micro_batch_size=2",
        f"train.global_batch_size={len(ROWS)}",
        "train.train_iters=2",
    )
    assert a.returncode == 0 and b.returncode == 0, (a.stderr[-2000:], b.stderr[-2000:])
    pa, pb = losses(tmp_path / "a"), losses(tmp_path / "b")
    for step in (1, 2):
        assert abs(pa[step] - pb[step]) <= 1e-5 * pb[step], (step, pa[step], pb[step])
    assert pa[2] < pa[1]


def test_per_sample_mask_weighs_samples_equally():
    import torch
    from loongforge.core.data import pack_samples
    from loongforge.core.data.text import per_sample_mask

    s = [
        {"tokens": torch.arange(n), "labels": torch.arange(n), "loss_mask": torch.tensor(m, dtype=torch.float32)}
        for n, m in ((3, [0, 1, 1]), (5, [0, 0, 1, 1, 1]), (2, [0, 0]))
    ]
    pack = pack_samples(s, [0, 1, 2], 12, pad_id=0)
    mask = per_sample_mask(pack)[0]
    assert torch.allclose(mask, torch.tensor([0, 0.5, 0.5, 0, 0, 1 / 3, 1 / 3, 1 / 3, 0, 0, 0, 0]))


def test_streaming_trains_and_resumes_exactly(rows_file, hf_llama4, tmp_path):
    args = ["data.streaming=true", "data.stream_buffer=6", "train.micro_batch_size=1", "train.global_batch_size=2"]
    r = _sft(rows_file, tmp_path / "full", hf_llama4, *args, "train.train_iters=6")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "streaming" in r.stdout
    full = losses(tmp_path / "full")
    assert min(full[s] for s in (4, 5, 6)) < full[1], full  # it trains (lr 5e-3 is high: later steps can spike)
    for iters in (3, 6):
        r = _sft(rows_file, tmp_path / "cut", hf_llama4, *args, f"train.train_iters={iters}")
        assert r.returncode == 0, r.stderr[-3000:]
    cut = losses(tmp_path / "cut")
    for step in (4, 5, 6):
        assert abs(cut[step] - full[step]) <= 1e-6 * full[step], (step, cut[step], full[step])
    g = tmp_path / "none.jsonl"
    g.write_text(json.dumps({"instruction": "x"}) + "\n")
    r = run_cli(["train", "sft", *COMMON, f"data.datasets=[{{path: {g}, format: alpaca}}]", *args, f"checkpoint.run_dir={tmp_path / 'c'}"])
    assert r.returncode == 2 and "no usable rows" in r.stderr, r.stderr[-2000:]
