"""The VLM stack on a CUDA GPU (skipped on CPU): bf16 logits of the composed model on the CUDA op
table (flash varlen attention, Triton rotary) against HF's fp32 model; a training forward and
backward on a pack as the task hands it over makes no host sync; the demo trains in bf16 through
the CLI with and without activation recompute."""

import pytest
import torch
from conftest import losses, run_cli
from test_vlm_model import IMG, batch, ctx, hf_dir  # noqa: F401  (hf_dir: the module's fixture)

pytestmark = pytest.mark.gpu


def cuda_model(hf_dir):  # noqa: F811
    """The HF directory's model built in bf16 on the CUDA op table (its rotary frequencies fp32)."""
    from loongforge.core.foundation import hf_io
    from loongforge.core.foundation.families import QWEN2
    from loongforge.core.foundation.hf_mapping import hf_to_lf
    from loongforge.core.ops import OpTable
    from loongforge.core.registry import registry
    from loongforge.vlm.model import VisionLanguageModel, read_hf_config, vlm_table

    family, cfg = read_hf_config(hf_dir, {"qwen2": QWEN2})
    model = VisionLanguageModel.build(family, cfg, ctx(), OpTable.build(None, registry(), "cuda"), params_dtype=torch.bfloat16)
    model.load_lf(hf_to_lf(vlm_table(family, cfg.arch), hf_io.load_hf_state(hf_dir), model.cfg))
    return model.cuda()


def test_bf16_logits_close_to_hf_fp32(hf_dir):  # noqa: F811
    from transformers import Qwen2_5_VLForConditionalGeneration

    ref = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    ours = cuda_model(hf_dir).eval()
    b = batch()
    with torch.no_grad():
        want = ref(**b).logits
    got = ours.hf_logits(**{k: (v.cuda() if torch.is_tensor(v) else v) for k, v in b.items()}).float().cpu()
    keep = b["attention_mask"].bool()
    err = (got[keep] - want[keep]).double().norm() / want[keep].double().norm()
    assert err < 2e-2, float(err)


def test_training_step_makes_no_host_sync(hf_dir):  # noqa: F811
    """Forward and backward of a pack on the device (the grids, the longest sample and the pad
    tokens' positions from the host, as `VLMTask.device_pack` gives them) under torch's sync debug
    mode set to raise."""
    from loongforge.core.accelerator import to_device
    from loongforge.vlm.model import sample_positions, token_types, vision_index

    model = cuda_model(hf_dir).train()
    b = batch()
    row = b["input_ids"][0][b["attention_mask"][0].bool()]
    pos, _ = sample_positions(model.cfg, token_types(model.cfg, row), b["image_grid_thw"])
    n = len(row)
    pack = {
        "tokens": row[None],
        "positions": pos,
        "cu_seqlens": torch.tensor([0, n], dtype=torch.int32),
        "labels": torch.roll(row, -1)[None],
        "loss_weights": torch.ones(1, n),
        "pixel_values": b["pixel_values"].bfloat16(),
        **vision_index(model.cfg, row[None]),
    }
    dev = {k: to_device(v, "cuda") for k, v in pack.items()}
    assert int((row == IMG).sum()) == 28
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = model(
            dev["tokens"],
            dev["positions"],
            dev["cu_seqlens"],
            labels=dev["labels"],
            loss_weights=dev["loss_weights"],
            max_seqlen=n,
            pixel_values=dev["pixel_values"],
            image_grid_thw=b["image_grid_thw"],
            image_index=dev["image_index"],
            video_index=dev["video_index"],
        )
        out.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(out).all()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
    assert model.vision.blocks[0].qkv.weight.grad is not None


@pytest.mark.parametrize("recompute", [False, True])
def test_demo_trains_in_bf16_on_cuda(tmp_path, recompute, monkeypatch):
    monkeypatch.setenv("LOONGFORGE_DEVICE", "cuda")
    r = run_cli(
        [
            "train",
            "qwen2_5_vl_tiny",
            "train.train_iters=60",
            "train.params_dtype=bfloat16",
            f"train.recompute={str(recompute).lower()}",
            f"checkpoint.run_dir={tmp_path}",
        ],
        module="loongforge.vlm.cli",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = losses(tmp_path)
    assert got[60] < 0.6 * got[10], got
