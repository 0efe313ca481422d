"""GPU checks (run on the lent H200; skipped on CPU): bf16 training of the megatron-core model
through the CLI, bf16 logits against HF, the trainer's non-blocking verdict read."""

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


def test_cuda_both_stacks_train_alike(tmp_path):
    """The same HF start on the megatron stack and on the torch stack (HF model under FSDP2, bf16
    compute over fp32 masters on both): bf16 rounding differs between the two models' kernels,
    so the curves agree to 2% per step, and both fall."""
    import os

    make_hf_model("llama", tmp_path / "hf", num_hidden_layers=4)
    os.environ["LOONGFORGE_DEVICE"] = "cuda"
    curves = {}
    try:
        for stack in ("megatron", "torch"):
            r = run_cli(
                [
                    "train",
                    "tiny",
                    *FAST,
                    "train.train_iters=10",
                    f"checkpoint.load={tmp_path / 'hf'}",
                    f"parallel.stack={stack}",
                    "parallel.data_parallel_mode=fsdp",
                    f"checkpoint.run_dir={tmp_path / stack}",
                ]
            )
            assert r.returncode == 0, r.stderr[-3000:]
            curves[stack] = losses(tmp_path / stack)
    finally:
        os.environ["LOONGFORGE_DEVICE"] = "cpu"
    for step, want in curves["megatron"].items():
        assert abs(curves["torch"][step] - want) <= 2e-2 * want, (step, curves["torch"][step], want)
    assert curves["torch"][10] < curves["torch"][1]


def test_verdict_copy_does_not_wait_for_later_work():
    """The trainer reads the previous step's NaN/Inf verdict through a HostCopy: it holds the
    value at the time of the copy and waits for that copy only, not for work queued after it
    (here about a second of spinning; the read returns long before)."""
    import time

    from loongforge.core.train.trainer import HostCopy

    t = torch.ones((), device="cuda")
    copy = HostCopy(t)
    torch.cuda._sleep(2_000_000_000)  # ~1 s at the H200's clock
    t.zero_()
    start = time.perf_counter()
    value = copy.get()
    waited = time.perf_counter() - start
    assert value.item() == 1.0
    torch.cuda.synchronize()
    assert waited < 0.25, f"HostCopy.get() waited {waited:.2f}s: it waited for work queued after the copy"
