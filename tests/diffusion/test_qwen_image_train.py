"""`loongforge-diffusion train qwen_image_tiny`: Qwen-Image trained by flow matching on image
latents with each sample's real text tokens; the task's loss equals a by-hand loss on diffusers'
QwenImageTransformer2DModel; the demo trains, generates a png and converts to diffusers."""

import pytest
import torch
from conftest import losses, run_cli

MODULE = "loongforge.diffusion.cli"


def test_task_loss_equals_flow_matching_by_hand_on_diffusers_model():
    from diffusers import QwenImagePipeline, QwenImageTransformer2DModel
    from loongforge.core.foundation.hf_mapping import lf_to_hf
    from loongforge.diffusion.config import QwenImageRunConfig
    from loongforge.diffusion.flow_matching import sample_u, shift_sigma
    from loongforge.diffusion.models.qwen_image import QWEN_IMAGE_TABLE
    from loongforge.diffusion.task import QwenImageTask

    cfg = QwenImageRunConfig()
    cfg.flow.shift, cfg.flow.caption_dropout = 3.0, 0.0
    d = cfg.model.joint_attention_dim
    items = [
        {"latents": torch.randn(4, 1, 4, 6), "text": torch.randn(5, d)},
        {"latents": torch.randn(4, 1, 6, 2), "text": torch.randn(3, d)},
    ]

    class Latents(list):
        meta = {"latent_channels": 4, "text_dim": d}
        get = list.__getitem__

    task = QwenImageTask(cfg, Latents(items), torch.zeros(1, d), 0, 1, torch.device("cpu"), None)
    torch.manual_seed(0)
    model = task.build_model()
    mb = {"latents": [it["latents"] for it in items], "text": [it["text"] for it in items], "seed": 3}
    with torch.no_grad():
        total, weight, _ = task.loss(model, mb)

    ref = QwenImageTransformer2DModel(**{k: v for k, v in cfg.model.diffusers_config().items() if not k.startswith("_")}).eval()
    ref.load_state_dict(lf_to_hf(QWEN_IMAGE_TABLE, model.state_dict(), cfg.model))
    g = torch.Generator().manual_seed(3)
    sigma = shift_sigma(sample_u(cfg.flow, 2, g, "cpu"), 3.0)
    torch.rand(2, generator=g)  # caption dropout's draw
    want = []
    for it, s in zip(items, sigma):
        x0 = it["latents"]
        noise = torch.randn(x0.shape, generator=g)
        _, _, h, w = x0.shape
        packed = QwenImagePipeline._pack_latents(((1 - s) * x0 + s * noise)[None, :, 0], 1, 4, h, w)
        with torch.no_grad():
            pred = ref(packed, it["text"][None], None, s[None], [[(1, h // 2, w // 2)]], return_dict=False)[0]
        target = QwenImagePipeline._pack_latents((noise - x0)[None, :, 0], 1, 4, h, w)
        want.append((pred - target).square().mean())
    assert weight.item() == 2.0
    assert abs(total.item() - sum(want).item()) <= 1e-5 * abs(sum(want).item())


def test_demo_trains_generates_and_converts(tmp_path):
    from diffusers import QwenImageTransformer2DModel
    from loongforge.diffusion import load_model

    run = tmp_path / "run"
    r = run_cli(["train", "qwen_image_tiny", "train.train_iters=40", "data.demo.count=8", f"checkpoint.run_dir={run}"], module=MODULE)
    assert r.returncode == 0, r.stderr[-3000:]
    got = losses(run)
    assert got[40] < 0.7 * got[10], got
    png = tmp_path / "one.png"
    g = run_cli(["generate", str(run), "--prompt", "a red square", "--frames", "1", "--out", str(png), "--steps", "3"], module=MODULE)
    assert g.returncode == 0 and png.is_file(), g.stderr[-3000:]
    bad = run_cli(["generate", str(run), "--prompt", "x", "--out", str(tmp_path / "v.mp4")], module=MODULE)
    assert bad.returncode == 2 and "generates images" in bad.stderr.strip().splitlines()[-1]
    c = run_cli(["convert", str(run), str(tmp_path / "export")], module=MODULE)
    assert c.returncode == 0, c.stderr[-3000:]
    hf = QwenImageTransformer2DModel.from_pretrained(tmp_path / "export")
    x, text, t = torch.randn(1, 6, 16), torch.randn(1, 5, 24), torch.tensor([0.5])
    with torch.no_grad():
        want = hf(x, text, None, t, [[(1, 2, 3)]], return_dict=False)[0]
        got = load_model(run)(hidden_states=x, encoder_hidden_states=text, timestep=t, img_shapes=[[(1, 2, 3)]])
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5


@pytest.mark.parametrize(
    "override,message",
    [
        ("parallel.context_parallel_size=2", "parallel.context_parallel_size=2: not supported for Qwen-Image"),
        ("boundary_ratio=0.5", "boundary_ratio=0.5"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, override, message):
    r = run_cli(["train", "qwen_image_tiny", "train.train_iters=1", f"checkpoint.run_dir={tmp_path}", override], module=MODULE)
    assert r.returncode == 2, r.stderr[-3000:]
    assert message in r.stderr.strip().splitlines()[-1]
