"""Qwen-Image (MMDiT) against diffusers' QwenImageTransformer2DModel on tiny random configs:
outputs within 1e-5 relative (fp32, CPU) at two resolutions with a text mask, packed samples of
different sizes and text lengths equal to each alone, diffusers -> LoongForge -> diffusers every
tensor bit-identical, the export running in QwenImagePipeline, `load_model` with diffusers'
arguments, unimplemented config fields named."""

import json

import pytest
import torch
from loongforge.core.errors import UserError
from loongforge.core.foundation.hf_mapping import hf_to_lf
from loongforge.diffusion.models.qwen_image import QWEN_IMAGE_TABLE, JointPack, QwenImageConfig, QwenImageDiT, predict

CFG = QwenImageConfig(
    patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=24
)


def rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def diffusers_model(cfg=CFG):
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(**{k: v for k, v in cfg.diffusers_config().items() if not k.startswith("_")}).eval()


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    ref = diffusers_model()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))  # (zero-initialized biases and tables made nonzero)
    ours = QwenImageDiT(CFG).eval()
    ours.load_state_dict(hf_to_lf(QWEN_IMAGE_TABLE, ref.state_dict(), CFG), strict=True)
    return ref, ours


@pytest.mark.parametrize("hw", [(4, 6), (5, 3)])
def test_outputs_match_diffusers_with_a_text_mask(pair, hw):
    ref, ours = pair
    h, w = hw
    torch.manual_seed(1)
    x, c, t = torch.randn(2, h * w, 16), torch.randn(2, 7, 24), torch.tensor([0.3, 0.9])
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 4:] = 0
    with torch.no_grad():
        want = ref(x, c, mask, t, [[(1, h, w)]] * 2, return_dict=False)[0]
        got = predict(ours, x, c, mask, t, [[(1, h, w)]] * 2)
        other = predict(ours, x, c, None, t, [[(1, h, w)]] * 2)  # negative control: the masked text counts
    assert rel(got, want) < 1e-5
    assert rel(other[1], want[1]) > 1e-4


def test_packed_samples_of_different_sizes_equal_each_alone(pair):
    ref, ours = pair
    torch.manual_seed(2)
    shapes, lens = [(1, 4, 6), (1, 2, 2), (1, 3, 5)], [7, 3, 5]
    xs = [torch.randn(f * h * w, 16) for f, h, w in shapes]
    cs = [torch.randn(n, 24) for n in lens]
    t = torch.tensor([0.1, 0.5, 0.95])
    with torch.no_grad():
        out = ours(torch.cat(xs), torch.cat(cs), t, JointPack.of(shapes, lens, "cpu"))
        for i, (x, c, s) in enumerate(zip(xs, cs, shapes)):
            want = ref(x[None], c[None], None, t[i : i + 1], [[s]], return_dict=False)[0][0]
            start = sum(len(v) for v in xs[:i])
            assert rel(out[start : start + len(x)], want) < 1e-5, i


def test_round_trip_pipeline_and_load_model(pair, tmp_path):
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline, QwenImageTransformer2DModel
    from loongforge.diffusion import load_model
    from loongforge.diffusion.model_io import read_diffusers, write_diffusers

    ref, _ = pair
    ref.save_pretrained(tmp_path / "hf")
    cfg, state = read_diffusers(tmp_path / "hf")
    assert cfg == CFG
    (tmp_path / "out").mkdir()
    write_diffusers(cfg, state, tmp_path / "out")
    back = QwenImageTransformer2DModel.from_pretrained(tmp_path / "out")
    a, b = ref.state_dict(), back.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)

    vae = AutoencoderKLQwenImage(
        base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, latents_mean=[0.0] * 4, latents_std=[1.0] * 4
    )  # 4 latent channels: 16 packed
    pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None, transformer=back)
    embeds = torch.randn(1, 5, 24)
    images = pipe(
        prompt_embeds=embeds,
        prompt_embeds_mask=torch.ones(1, 5, dtype=torch.long),
        height=32,
        width=32,
        num_inference_steps=2,
        output_type="pt",
    ).images
    assert tuple(images.shape) == (1, 3, 32, 32)

    model = load_model(tmp_path / "out")
    x, t = torch.randn(1, 12, 16), torch.tensor([0.4])
    with torch.no_grad():
        got = model(hidden_states=x, encoder_hidden_states=embeds, encoder_hidden_states_mask=None, timestep=t, img_shapes=[[(1, 3, 4)]])
        assert rel(got, ref(x, embeds, None, t, [[(1, 3, 4)]], return_dict=False)[0]) < 1e-5


@pytest.mark.parametrize(
    "change,message",
    [
        ({"guidance_embeds": True}, "guidance_embeds=True is not implemented"),
        ({"zero_cond_t": True}, "zero_cond_t=True is not implemented"),
        ({"use_layer3d_rope": True}, "use_layer3d_rope=True is not implemented"),
        ({"axes_dims_rope": [4, 4, 4]}, "summing to attention_head_dim=16"),
        ({"sample_size": 128}, "field 'sample_size' of QwenImageTransformer2DModel is not implemented"),
    ],
)
def test_unimplemented_config_fields_are_named(tmp_path, change, message):
    from loongforge.diffusion.model_io import read_diffusers

    (tmp_path / "config.json").write_text(json.dumps({**CFG.diffusers_config(), **change}))
    with pytest.raises(UserError) as e:
        read_diffusers(tmp_path)
    assert message in str(e.value)
