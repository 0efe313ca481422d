"""`vlm.sft` end to end on the shipped demo (generated shapes, tiny Qwen2.5-VL): the loss falls;
the HF export loads in transformers and gives the logits of `load_model` on the run; generate
answers; an HF start keeps its weights; the language model swaps with one line (Llama, Qwen3)
and trains; resume is exact; TP=2 and DP=2 on 2 gloo processes give the single-process losses;
bad input is one line and exit 2."""

import json
import re
import shutil

import pytest
import torch
from conftest import losses, run_cli

VLM = "loongforge.vlm.cli"
# a short demo run: 48 generated samples in 128-token packs of 4 per step
FAST = [
    "data.demo_samples=48",
    "data.seq_length=128",
    "train.global_batch_size=4",
    "train.log_interval=1",
    "train.lr_warmup_iters=2",
]


def train(run_dir, *extra, nproc=1, steps=12):
    r = run_cli(
        ["train", "qwen2_5_vl_tiny", *FAST, f"train.train_iters={steps}", f"checkpoint.run_dir={run_dir}", *extra], nproc=nproc, module=VLM
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return losses(run_dir)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("vlm") / "run"
    got = train(d, "train.save_interval=6", steps=12)
    return d, got


def demo_inputs(run_dir, n: int = 3):
    """The processor outputs of the first `n` demo samples' prompts (HF keyword names, batched)."""
    from loongforge.core.data.text import load_tokenizer
    from loongforge.vlm.data import VisionProcessorConfig, VisionSampleEncoder, read_records

    tok = load_tokenizer(str(run_dir / "tokenizer"))
    enc = VisionSampleEncoder(tok, VisionProcessorConfig(min_pixels=3136, max_pixels=12544), max_length=512)
    samples = [enc(r) for r in list(read_records([str(run_dir / "data" / "demo" / "data.json")]))[:n]]
    s = max(len(x["input_ids"]) for x in samples)
    ids = torch.zeros(len(samples), s, dtype=torch.long)
    mask = torch.zeros(len(samples), s, dtype=torch.long)
    types = torch.zeros(len(samples), s, dtype=torch.long)
    for i, x in enumerate(samples):
        ids[i, : len(x["input_ids"])], mask[i, : len(x["input_ids"])] = x["input_ids"], 1
        types[i, : len(x["input_ids"])] = x["mm_token_type_ids"]
    pix = [x["pixel_values"] for x in samples if x["pixel_values"] is not None]
    grid = [x["image_grid_thw"] for x in samples if x["image_grid_thw"] is not None]
    return dict(input_ids=ids, attention_mask=mask, mm_token_type_ids=types, pixel_values=torch.cat(pix), image_grid_thw=torch.cat(grid))


def test_demo_loss_falls_and_export_matches(demo_run):
    from loongforge.vlm import load_model
    from transformers import Qwen2_5_VLForConditionalGeneration

    run_dir, got = demo_run
    assert sorted(got) == list(range(1, 13))
    assert sum(got[s] for s in range(10, 13)) / 3 < 0.85 * got[1], got
    b = demo_inputs(run_dir)
    ours = load_model(run_dir).hf_logits(**b)
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(run_dir / "hf"), dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(**b).logits
    keep = b["attention_mask"].bool()
    assert (ours[keep] - want[keep]).abs().max() / want[keep].abs().max() < 1e-5
    assert torch.equal(load_model(run_dir / "hf").hf_logits(**b), ours)


def test_generate_answers_as_hf_generate(demo_run):
    """`generate` (CLI and Python) gives the tokens HF `generate` gives on the export."""
    from loongforge.core.data.text import load_tokenizer
    from loongforge.vlm.data import VisionProcessorConfig, VisionRecord, VisionSampleEncoder
    from loongforge.vlm.generate import answer
    from transformers import Qwen2_5_VLForConditionalGeneration

    run_dir, _ = demo_run
    image = sorted((run_dir / "data" / "demo" / "images").iterdir())[0]
    got = answer(run_dir, "What color is the shape?", [str(image)], 6)
    tok = load_tokenizer(str(run_dir / "tokenizer"))
    enc = VisionSampleEncoder(tok, VisionProcessorConfig(min_pixels=3136, max_pixels=12544), max_length=512)
    record = VisionRecord(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What color is the shape?"}]}], images=[str(image)]
    )
    x = enc.prompt(record)
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(run_dir / "hf"), dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(
            input_ids=x["input_ids"][None],
            mm_token_type_ids=x["mm_token_type_ids"][None],
            pixel_values=x["pixel_values"],
            image_grid_thw=x["image_grid_thw"],
            max_new_tokens=6,
            do_sample=False,
            eos_token_id=tok.eos_token_id,
        )
    assert got == tok.decode(out[0, x["input_ids"].numel() :], skip_special_tokens=True).strip()
    r = run_cli(
        ["generate", str(run_dir), "--image", str(image), "--prompt", "What color is the shape?", "--max-new-tokens", "6"], module=VLM
    )
    assert r.returncode == 0 and r.stdout.strip() == got, (r.stdout, got, r.stderr[-2000:])
    r = run_cli(["generate", str(run_dir), "--image", str(run_dir / "missing.png"), "--prompt", "?"], module=VLM)
    assert r.returncode == 2 and "missing.png: no such file" in r.stderr


def test_resume_is_exact(demo_run, tmp_path):
    """The step-6 checkpoint of the demo run, resumed by the same command: steps 7..12 as before."""
    run_dir, full = demo_run
    cut = tmp_path / "run"
    shutil.copytree(run_dir, cut)
    shutil.rmtree(cut / "checkpoints" / "step_00000012")
    (cut / "checkpoints" / "latest").write_text("step_00000006")
    shutil.rmtree(cut / "hf")
    rows = [json.loads(line) for line in (cut / "metrics.jsonl").read_text().splitlines()]
    (cut / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if r["step"] <= 6))
    got = train(cut, "train.save_interval=6", steps=12)
    for step in range(7, 13):
        assert abs(got[step] - full[step]) <= 1e-6 * abs(full[step]), (step, got[step], full[step])


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_language_model_swaps_in_one_line(family, tmp_path):
    got = train(tmp_path / "run", f"model.language.family={family}", "checkpoint.export_hf=false", steps=3)
    assert sorted(got) == [1, 2, 3] and all(v == v for v in got.values())
    manifest = json.loads(next((tmp_path / "run" / "checkpoints").glob("step_*/manifest.json")).read_text())
    assert manifest["config"]["model"]["language"]["family"] == family


def test_hf_start_keeps_its_weights(demo_run, tmp_path):
    """checkpoint.load of an HF export: after a zero-LR step the run's weights are the HF ones."""
    from loongforge.vlm import load_model

    run_dir, _ = demo_run
    train(tmp_path / "run", f"checkpoint.load={run_dir / 'hf'}", "train.lr=0", "train.min_lr=0", "checkpoint.export_hf=false", steps=1)
    start, after = load_model(run_dir / "hf").lf_state(), load_model(tmp_path / "run").lf_state()
    assert set(start) == set(after) and all(torch.equal(start[k], after[k]) for k in start)


# 256-token packs hold three demo samples, so a TP rank's share of a pack's images is not all of them
SEVERAL_IMAGES = ["data.seq_length=256"]


@pytest.fixture(scope="module")
def single_from_hf(demo_run, tmp_path_factory):
    """4 steps of one process from the demo's HF export (the same start for every layout)."""
    run_dir, _ = demo_run
    d = tmp_path_factory.mktemp("single") / "run"
    return d, train(d, *SEVERAL_IMAGES, f"checkpoint.load={run_dir / 'hf'}", "checkpoint.export_hf=false", steps=4)


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout", ["parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2", "parallel.tensor_model_parallel_size=1"]
)
def test_two_processes_match_one(layout, demo_run, single_from_hf, tmp_path):
    """TP=2 (the language model split, each rank encoding half of a pack's images), PP=2 (the
    ViT and the embedding on the first stage, packs padded to a fixed length) and DP=2 equal one
    process: the losses, and the trained weights of every part."""
    from loongforge.vlm import load_model

    run_dir, _ = demo_run
    single_dir, single = single_from_hf
    got = train(
        tmp_path / "run", layout, *SEVERAL_IMAGES, f"checkpoint.load={run_dir / 'hf'}", "checkpoint.export_hf=false", nproc=2, steps=4
    )
    for step in range(1, 5):
        assert abs(got[step] - single[step]) <= 1e-5 * abs(single[step]), (layout, step, got[step], single[step])
    assert single[4] < single[1]
    want, have = load_model(single_dir).lf_state(), load_model(tmp_path / "run").lf_state()
    start = load_model(run_dir / "hf").lf_state()
    for k, w in want.items():
        moved = (w - start[k]).abs().max()
        assert (have[k] - w).abs().max() <= 1e-2 * moved + 1e-6, (layout, k, float((have[k] - w).abs().max()), float(moved))


@pytest.mark.parametrize(
    "override,message",
    [
        ("train.micro_batch_size=2", "set train.micro_batch_size=1"),
        ("model.language.mrope_section=[1,1,1]", "must sum to the 8 rotary pairs"),
        ("model.vision.out_hidden_size=32", "must equal model.language.hidden_size=64"),
        ("data.on_bad_sample=drop", "choose skip or error"),
        ("data.tokenizer=tiny-missing", "tokenizer not found"),
        ("model.language.vocab_size=400", "tokenizer has 500 tokens"),
        ("model.vision.window_sizes=[4]", "model.vision.window_sizes is not a field of the qwen2_5_vl vision tower"),
    ],
)
def test_bad_config_is_one_user_error(override, message):
    """The run's checks before anything is built or written, in process (the CLI's exit code and
    single line are the next test's)."""
    from loongforge.core.data.text import load_tokenizer
    from loongforge.core.errors import UserError
    from loongforge.core.recipes import resolve
    from loongforge.vlm.recipe import resolve_model, tokenizer_path, validate

    with pytest.raises(UserError, match=re.escape(message)):
        _, cfg = resolve("qwen2_5_vl_tiny", [override], prefer="vlm")
        tok = load_tokenizer(tokenizer_path(cfg.data.tokenizer))
        mcfg, _ = resolve_model(cfg, tok)
        validate(cfg, mcfg, tok)


@pytest.mark.parametrize(
    "override,message",
    [("parallel.stack=torch", "VLMs train on the megatron stack"), ("data.paths=[nowhere.json]", "nowhere.json")],
)
def test_bad_input_is_one_line(override, message, tmp_path):
    r = run_cli(["train", "qwen2_5_vl_tiny", f"checkpoint.run_dir={tmp_path / 'run'}", override], module=VLM)
    assert r.returncode == 2, (override, r.stderr[-2000:])
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], (override, r.stderr[-2000:])


def test_bad_samples_counted_or_an_error(tmp_path):
    from loongforge.vlm.data import write_demo_dataset

    demo = write_demo_dataset(tmp_path / "demo", samples=24)
    rows = json.loads((demo / "data.json").read_text())
    rows[1]["image"] = "images/gone.png"
    (demo / "data.json").write_text(json.dumps(rows))
    args = ["train", "qwen2_5_vl_tiny", *FAST, "train.train_iters=1", "checkpoint.export_hf=false", f"data.paths=[{demo / 'data.json'}]"]
    r = run_cli([*args, f"checkpoint.run_dir={tmp_path / 'a'}"], module=VLM)
    assert r.returncode == 0 and "skipped 1 missing_media" in r.stdout + r.stderr, r.stderr[-2000:]
    r = run_cli([*args, f"checkpoint.run_dir={tmp_path / 'b'}", "data.on_bad_sample=error"], module=VLM)
    assert r.returncode == 2 and "missing_media" in r.stderr, r.stderr[-2000:]


def test_packs_balanced_across_ranks():
    """data.balance=cost: each step's packs split over 2 ranks by cost, the same packs as the
    contiguous split, the heavier rank's cost no higher (on skewed costs, lower)."""
    from types import SimpleNamespace

    from loongforge.vlm.config import VLMRunConfig
    from loongforge.vlm.recipe import VLMTask

    cfg = VLMRunConfig()
    cfg.train.global_batch_size = 8
    costs = [float(1 + (i % 7) ** 3) for i in range(40)]
    packs = [{"id": torch.tensor(i), "tokens": torch.zeros(1, 4, dtype=torch.long), "cu_seqlens": torch.tensor([0, 4])} for i in range(40)]

    def shares(balance):
        cfg.data.balance = balance
        out = []
        for rank in (0, 1):
            task = VLMTask(cfg, cfg.model, None, SimpleNamespace(dp_rank=rank, dp_size=2), None, None, packs, "cpu", None, costs)
            it = task.batches(0)
            out.append([[int(mb["id"]) for mb in next(it)] for _ in range(5)])
        return [(out[0][s], out[1][s]) for s in range(5)]

    worse = 0
    for (b0, b1), (c0, c1) in zip(shares("cost"), shares("contiguous")):
        assert sorted(b0 + b1) == sorted(c0 + c1) and len(b0) == len(b1) == 4
        heavy = lambda a, b: max(sum(costs[i] for i in a), sum(costs[i] for i in b))  # noqa: E731
        assert heavy(b0, b1) <= heavy(c0, c1)
        worse += heavy(b0, b1) < heavy(c0, c1)
    assert worse > 0


def test_freeze_and_lr_mult_per_part(demo_run, tmp_path):
    """freeze.language and lr_mult.vision=0 keep those weights; the projector (merger) trains."""
    from loongforge.vlm import load_model

    run_dir, _ = demo_run
    train(
        tmp_path / "run",
        f"checkpoint.load={run_dir / 'hf'}",
        "freeze.language=true",
        "lr_mult.vision=0",
        "train.lr_warmup_iters=0",
        "checkpoint.export_hf=false",
        steps=2,
    )
    start, after = load_model(run_dir / "hf").lf_state(), load_model(tmp_path / "run").lf_state()
    changed = {k for k in start if not torch.equal(start[k], after[k])}
    assert changed and all(k.startswith("vision.merger") for k in changed), sorted(changed)[:5]
    assert {k for k in start if k.startswith("vision.merger")} == changed


def test_lora_run_loads_and_exports_merged(demo_run, tmp_path):
    """lora.rank > 0 from the demo's HF export: adapters on the language model (its base frozen),
    the ViT trained; `load_model` rebuilds the run from its base and checkpoint, and the HF export
    (adapters merged) gives the same logits."""
    from loongforge.vlm import load_model
    from transformers import Qwen2_5_VLForConditionalGeneration

    run_dir, _ = demo_run
    run = tmp_path / "run"
    train(run, f"checkpoint.load={run_dir / 'hf'}", "lora.rank=4", "train.lr=1e-2", "train.lr_warmup_iters=0", steps=3)
    b = demo_inputs(run_dir)
    keep = b["attention_mask"].bool()
    ours = load_model(run).hf_logits(**b)
    base = load_model(run_dir / "hf").hf_logits(**b)
    assert (ours[keep] - base[keep]).abs().max() > 1e-3  # the run changed the model
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(run / "hf"), dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(**b).logits
    assert (ours[keep] - want[keep]).abs().max() / want[keep].abs().max() < 1e-5


def test_preprocess_once_then_train(demo_run, tmp_path):
    """`preprocess` writes the packs a run would make; training from them gives its losses; a run
    whose config would pack differently is refused, and so is an existing output."""
    _, single = demo_run
    packs = tmp_path / "packs"
    r = run_cli(["preprocess", "qwen2_5_vl_tiny", str(packs), *FAST], module=VLM)
    assert r.returncode == 0, r.stderr[-2000:]
    meta = json.loads(r.stdout.strip().splitlines()[-1])
    assert meta["samples"] == 48 and meta["packs"] >= 4
    got = train(tmp_path / "run", f"data.prepacked={packs}", "train.save_interval=6", steps=12)
    for step, want in single.items():
        assert abs(got[step] - want) <= 1e-6 * abs(want), (step, got[step], want)
    r = run_cli(
        ["train", "qwen2_5_vl_tiny", *FAST, f"data.prepacked={packs}", "data.seq_length=256", f"checkpoint.run_dir={tmp_path / 'b'}"],
        module=VLM,
    )
    assert r.returncode == 2 and "was written with seq_length=128" in r.stderr, r.stderr[-2000:]
    r = run_cli(["preprocess", "qwen2_5_vl_tiny", str(packs), *FAST], module=VLM)
    assert r.returncode == 2, r.stderr[-2000:]


def test_recompute_per_part_keeps_the_losses(demo_run, tmp_path):
    """recompute.vision / recompute.language (each block's activations recomputed in backward)
    change no loss: 3 steps equal the demo run's first 3."""
    _, want = demo_run
    got = train(tmp_path / "rc", "recompute.vision=true", "recompute.language=true", steps=3)
    assert all(abs(got[s] - want[s]) <= 1e-6 * abs(want[s]) for s in (1, 2, 3)), (got, want)
