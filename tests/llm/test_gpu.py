"""GPU checks (run on the lent H200; skipped on CPU): bf16 training of the megatron-core model
through the CLI, and bf16 logits against HF."""

import pytest
import torch

from conftest import FAST, losses, make_hf_model, run_cli

pytestmark = pytest.mark.gpu


def test_bf16_logits_close_to_hf(tmp_path):
    from loongforge.llm import load_model

    hf = make_hf_model("llama", tmp_path / "hf", num_hidden_layers=4).cuda().bfloat16()
    ours = load_model(tmp_path / "hf").cuda().bfloat16()
    x = torch.randint(0, 512, (2, 64), device="cuda")
    with torch.no_grad():
        a, b = hf(x).logits.float(), ours(x).float()
    # bf16 carries 8 bits of mantissa: two different kernel orders differ by a few ulps.
    assert ((a - b).abs().max() / a.abs().max()) < 2e-2


def test_cuda_training_through_the_cli(tmp_path):
    import os

    os.environ["LOONGFORGE_DEVICE"] = "cuda"
    try:
        r = run_cli(["train", "tiny", *FAST, "train.train_iters=20", f"checkpoint.run_dir={tmp_path}"])
    finally:
        os.environ["LOONGFORGE_DEVICE"] = "cpu"
    assert r.returncode == 0, r.stderr[-3000:]
    curve = losses(tmp_path)
    assert curve[20] < curve[1]
