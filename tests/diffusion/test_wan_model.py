"""The Wan transformer against diffusers' WanTransformer3DModel (the oracle) on tiny random
configs: outputs within 1e-5 relative (fp32, CPU) at two resolutions, packed samples of different
sizes equal to each alone, per-token times (Wan2.2 TI2V) too; diffusers -> LoongForge -> diffusers
every tensor bit-identical; the export loads in WanPipeline; unimplemented config fields named."""

import json

import pytest
import torch
from loongforge.core.errors import UserError
from loongforge.core.foundation.hf_mapping import hf_to_lf, lf_to_hf
from loongforge.diffusion.models.wan import WAN_TABLE, WanConfig, WanDiT, patchify, predict, unpatchify

CFG = WanConfig(
    num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4, text_dim=16, freq_dim=32, ffn_dim=40, num_layers=2
)


def rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def pair():
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    ref = WanTransformer3DModel(**{k: v for k, v in CFG.diffusers_config().items() if not k.startswith("_")}).eval()
    with torch.no_grad():  # the zero-initialized-looking tables are random in diffusers too; make the biases nonzero
        for p in ref.parameters():
            p.add_(0.02 * torch.randn_like(p))
    ours = WanDiT(CFG).eval()
    ours.load_state_dict(hf_to_lf(WAN_TABLE, ref.state_dict(), CFG), strict=True)
    return ref, ours


@pytest.mark.parametrize("shape", [(2, 4, 3, 8, 6), (1, 4, 5, 4, 10)])
def test_outputs_match_diffusers(pair, shape):
    ref, ours = pair
    torch.manual_seed(1)
    x, t, c = torch.randn(shape), torch.rand(shape[0]) * 1000, torch.randn(shape[0], 7, CFG.text_dim)
    with torch.no_grad():
        want = ref(x, t, c, return_dict=False)[0]
        got = predict(ours, x, t, c)
        other = predict(ours, x, t.flip(0) + 1, c)  # negative control: another time changes the output
    assert got.shape == want.shape
    assert rel(got, want) < 1e-5
    assert rel(other, want) > 1e-3


def test_packed_samples_of_different_sizes_equal_each_alone(pair):
    ref, ours = pair
    torch.manual_seed(2)
    shapes = [(4, 3, 8, 6), (4, 1, 4, 4), (4, 5, 4, 10)]
    xs = [torch.randn(s) for s in shapes]
    t = torch.tensor([10.0, 500.0, 990.0])
    c = torch.randn(3, 7, CFG.text_dim)
    with torch.no_grad():
        patches, pack = patchify(xs, CFG)
        outs = unpatchify(ours(patches, pack, t, c), pack, CFG)
        for i, x in enumerate(xs):
            want = ref(x[None], t[i : i + 1], c[i : i + 1], return_dict=False)[0][0]
            assert rel(outs[i], want) < 1e-5, i
    assert patches.shape[0] == sum(s[1] * (s[2] // 2) * (s[3] // 2) for s in shapes)  # no padding
    rows, _ = patchify(outs, CFG, as_output=True)  # the output rows' layout, for the loss
    assert torch.equal(unpatchify(rows, pack, CFG)[1], outs[1])


def test_per_token_times_match_diffusers(pair):
    """Wan2.2 TI2V gives each patch token its own time ([batch, tokens])."""
    ref, ours = pair
    torch.manual_seed(3)
    x, c = torch.randn(2, 4, 3, 4, 6), torch.randn(2, 5, CFG.text_dim)
    t = torch.rand(2, 3 * 2 * 3) * 1000
    with torch.no_grad():
        assert rel(predict(ours, x, t, c), ref(x, t, c, return_dict=False)[0]) < 1e-5


def test_diffusers_to_ours_to_diffusers_is_bit_identical(pair, tmp_path):
    from diffusers import WanTransformer3DModel
    from loongforge.diffusion.model_io import read_diffusers, write_diffusers

    ref, ours = pair
    ref.save_pretrained(tmp_path / "hf")
    cfg, state = read_diffusers(tmp_path / "hf")
    assert cfg == CFG
    (tmp_path / "out").mkdir()
    write_diffusers(cfg, state, tmp_path / "out")
    back = WanTransformer3DModel.from_pretrained(tmp_path / "out")
    a, b = ref.state_dict(), back.state_dict()
    assert set(a) == set(b)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert set(lf_to_hf(WAN_TABLE, state, cfg)) == set(a)


def test_export_loads_in_wan_pipeline(pair, tmp_path):
    """The exported transformer in diffusers' WanPipeline (tiny VAE and text encoder) denoises."""
    from diffusers import UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from loongforge.diffusion.data import load_text_encoder, load_vae
    from loongforge.diffusion.model_io import write_diffusers

    tok, enc = load_text_encoder("tiny")
    cfg = WanConfig(**{**CFG.__dict__, "text_dim": enc.config.d_model})
    torch.manual_seed(0)
    ours = WanDiT(cfg)
    (tmp_path / "t").mkdir()
    write_diffusers(cfg, ours.state_dict(), tmp_path / "t")
    pipe = WanPipeline(
        tokenizer=tok,
        text_encoder=enc,
        vae=load_vae("tiny"),
        transformer=WanTransformer3DModel.from_pretrained(tmp_path / "t"),
        scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0),
    )
    video = pipe("a red square", num_frames=5, height=32, width=32, num_inference_steps=2, output_type="pt").frames
    assert tuple(video.shape) == (1, 5, 3, 32, 32)


def test_load_model_takes_diffusers_arguments(pair, tmp_path):
    from loongforge.diffusion import load_model

    ref, _ = pair
    ref.save_pretrained(tmp_path / "transformer")
    model = load_model(tmp_path)  # a pipeline directory: its transformer/
    x, t, c = torch.randn(1, 4, 3, 4, 4), torch.tensor([300.0]), torch.randn(1, 6, CFG.text_dim)
    with torch.no_grad():
        got = model(hidden_states=x, timestep=t, encoder_hidden_states=c)
        assert rel(got, ref(x, t, c, return_dict=False)[0]) < 1e-5


@pytest.mark.parametrize(
    "change,message",
    [
        ({"pos_embed_seq_len": 514}, "pos_embed_seq_len=514 (Wan first-last-frame-to-video) is not implemented"),
        ({"added_kv_proj_dim": 24}, "model.image_dim and model.added_kv_proj_dim come together"),
        ({"window_size": [-1, -1]}, "field 'window_size' of WanTransformer3DModel is not implemented"),
        ({"qk_norm": "rms_norm"}, "only 'rms_norm_across_heads'"),
        ({"_class_name": "FluxTransformer2DModel"}, "a FluxTransformer2DModel; supported diffusers transformers: WanTransformer3DModel"),
    ],
)
def test_unimplemented_config_fields_are_named(tmp_path, change, message):
    from loongforge.diffusion.model_io import read_diffusers

    (tmp_path / "config.json").write_text(json.dumps({**CFG.diffusers_config(), **change}))
    with pytest.raises(UserError) as e:
        read_diffusers(tmp_path)
    assert message in str(e.value)


def test_two_experts_route_each_sample_by_its_time(pair):
    """Wan2.2 A14B: samples at t >= boundary go to the high-noise transformer, the rest to the
    low-noise one (each equal to diffusers' model with that expert's weights); a pack with no
    low-noise sample still runs the low expert (zero-weighted), so its weights get gradients."""
    from diffusers import WanTransformer3DModel
    from loongforge.core.foundation.hf_mapping import lf_to_hf
    from loongforge.diffusion.models.wan import WanExperts

    torch.manual_seed(5)
    model = WanExperts(CFG, boundary=875.0)
    refs = {}
    for name in ("high", "low"):
        refs[name] = WanTransformer3DModel(**{k: v for k, v in CFG.diffusers_config().items() if not k.startswith("_")}).eval()
        refs[name].load_state_dict(lf_to_hf(WAN_TABLE, getattr(model, name).state_dict(), CFG))
    xs = [torch.randn(4, 3, 4, 6), torch.randn(4, 1, 4, 4), torch.randn(4, 5, 2, 2)]
    t = torch.tensor([900.0, 100.0, 875.0])
    c = torch.randn(3, 7, CFG.text_dim)
    patches, pack = patchify(xs, CFG)
    with torch.no_grad():
        outs = unpatchify(model(patches, pack, t, c), pack, CFG)
    for i, name in enumerate(("high", "low", "high")):
        want = refs[name](xs[i][None], t[i : i + 1], c[i : i + 1], return_dict=False)[0][0]
        assert rel(outs[i], want) < 1e-5, (i, name)
    only_high = model(*patchify(xs[:1], CFG), t[:1], c[:1])
    only_high.square().sum().backward()
    assert all(p.grad is not None for p in model.low.parameters())
    assert all(p.grad.abs().max() == 0 for p in model.low.parameters())
    assert any(p.grad.abs().max() > 0 for p in model.high.parameters())


def test_image_to_video_matches_diffusers():
    """Wan2.1 I2V: CLIP image features through their own projection and k / v in every
    cross-attention, added to the text attention (diffusers splits them off a 512-token text)."""
    from diffusers import WanTransformer3DModel
    from loongforge.diffusion.model_io import DiffusersCall

    cfg = WanConfig(**{**CFG.__dict__, "in_channels": 8, "image_dim": 20, "added_kv_proj_dim": CFG.hidden_size})
    torch.manual_seed(6)
    ref = WanTransformer3DModel(**{k: v for k, v in cfg.diffusers_config().items() if not k.startswith("_")}).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.02 * torch.randn_like(p))
    ours = WanDiT(cfg).eval()
    ours.load_state_dict(hf_to_lf(WAN_TABLE, ref.state_dict(), cfg), strict=True)
    assert set(lf_to_hf(WAN_TABLE, ours.state_dict(), cfg)) == set(ref.state_dict())
    x, t = torch.randn(2, 8, 3, 4, 6), torch.tensor([100.0, 700.0])
    text, image = torch.randn(2, 512, CFG.text_dim), torch.randn(2, 9, 20)
    with torch.no_grad():
        want = ref(x, t, text, encoder_hidden_states_image=image, return_dict=False)[0]
        got = DiffusersCall(ours)(x, t, text, encoder_hidden_states_image=image)
    assert rel(got, want) < 1e-5
    with pytest.raises(ValueError, match="image_context is required"):
        predict(ours, x, t, text)
