"""TP=2 (with and without sequence parallelism), PP=2 and DP=2 on 2 gloo processes give the single-process losses (same HF
start)."""

import json

import pytest
import torch
from conftest import FAST, losses, run_cli
from safetensors.torch import load_file

pytestmark = pytest.mark.slow
STEPS = 4


@pytest.fixture(scope="module")
def single(hf_llama4, tmp_path_factory):
    d = tmp_path_factory.mktemp("single")
    r = run_cli(["train", "tiny", *FAST, f"train.train_iters={STEPS}", f"checkpoint.load={hf_llama4}", f"checkpoint.run_dir={d}"])
    assert r.returncode == 0, r.stderr[-3000:]
    return losses(d)


@pytest.mark.parametrize(
    "layout",
    [
        "parallel.tensor_model_parallel_size=2",
        "parallel.tensor_model_parallel_size=2 parallel.sequence_parallel=true",
        "parallel.pipeline_model_parallel_size=2",
        "parallel.tensor_model_parallel_size=1",
    ],
)
def test_two_process_layout_matches_single(layout, single, hf_llama4, tmp_path):
    r = run_cli(
        [
            "train",
            "tiny",
            *FAST,
            f"train.train_iters={STEPS}",
            f"checkpoint.load={hf_llama4}",
            f"checkpoint.run_dir={tmp_path}",
            *layout.split(),
        ],
        nproc=2,
        torchrun=layout == "parallel.tensor_model_parallel_size=2",  # one job as the README starts it
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = losses(tmp_path)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, want in single.items():
        assert abs(got[step] - want) <= 1e-5 * abs(want), (layout, step, got[step], want)
    # training moved: the losses are not a constant that would match trivially
    assert single[STEPS] < single[1]


def test_qk_norms_at_tensor_parallel_two_match_single(tmp_path):
    """Qwen3's q/k norms are shared by every head, and each TP rank holds half of the heads: their
    gradients sum over the TP group (without sequence parallelism too), so TP=2 trains as one
    process does. The norms start away from 1 so that a wrong gradient shows in the losses."""
    from conftest import make_hf_model

    hf = make_hf_model("qwen3", tmp_path / "init", head_dim=16)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "q_norm" in name or "k_norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    hf.save_pretrained(str(tmp_path / "hf"))
    runs = {}
    for tp in (1, 2):
        d = tmp_path / f"tp{tp}"
        args = ["train", "tiny", *FAST, f"train.train_iters={STEPS}", f"checkpoint.load={tmp_path / 'hf'}", f"checkpoint.run_dir={d}"]
        r = run_cli([*args, f"parallel.tensor_model_parallel_size={tp}", "checkpoint.export_hf=true"], nproc=tp)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[tp] = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    for one, two in zip(runs[1], runs[2], strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(two[key] - one[key]) <= 1e-5 * abs(one[key]), (one["step"], key, two[key], one[key])
    # the trained weights (four AdamW steps move a weight by ~1e-2; the layouts' fp32 sums differ
    # in order, which Adam turns into ~1e-5 where a gradient is near zero: 1e-4 is 1% of a step)
    one, two = (load_file(str(tmp_path / f"tp{tp}" / "hf" / "model.safetensors")) for tp in (1, 2))
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=0, atol=1e-4, msg=key)
