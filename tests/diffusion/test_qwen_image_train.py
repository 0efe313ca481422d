"""`loongforge-diffusion train qwen_image_tiny`: Qwen-Image trained by flow matching on image
latents with each sample's real text tokens; the task's loss equals a by-hand loss on diffusers'
QwenImageTransformer2DModel (static shift, and each sample at its own size's shift); the sampler's
sigmas equal QwenImagePipeline's size-dependent ones; the demo trains, generates a png and
converts to diffusers."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import losses, run_cli

MODULE = "loongforge.diffusion.cli"

# Qwen/Qwen-Image scheduler/scheduler_config.json (the published file's keys and values)
PUBLISHED_SCHEDULER = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "invert_sigmas": False,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "stochastic_sampling": False,
    "time_shift_type": "exponential",
    "use_beta_sigmas": False,
    "use_dynamic_shifting": True,
    "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}


def exponential_shift(u: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """Independently of ours: mu by diffusers' calculate_shift at the published values, then
    diffusers' exponential time shift e^mu / (e^mu + (1/u - 1))."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    mu = torch.tensor([calculate_shift(n, 256, 8192, 0.5, 0.9) for n in tokens], dtype=torch.float64)
    return (mu.exp() / (mu.exp() + (1 / u.double() - 1))).float()


@pytest.mark.parametrize("training_shift", ["static", "dynamic"])
def test_task_loss_equals_flow_matching_by_hand_on_diffusers_model(training_shift):
    from diffusers import QwenImagePipeline, QwenImageTransformer2DModel
    from loongforge.core.foundation.hf_mapping import lf_to_hf
    from loongforge.diffusion.config import QwenImageRunConfig
    from loongforge.diffusion.flow_matching import sample_u, shift_sigma
    from loongforge.diffusion.models.qwen_image import QWEN_IMAGE_TABLE
    from loongforge.diffusion.task import QwenImageTask

    cfg = QwenImageRunConfig()
    cfg.flow.shift, cfg.flow.caption_dropout, cfg.flow.training_shift = 3.0, 0.0, training_shift
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
    u = sample_u(cfg.flow, 2, g, "cpu")
    # dynamic: each sample at the shift of its own packed-token count (2 x 3 and 3 x 1 patches)
    sigma = shift_sigma(u, 3.0) if training_shift == "static" else exponential_shift(u, [6, 3])
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


def test_training_sigma_is_each_samples_own_size_shift():
    """training_shift: dynamic: a sample's sigma is the exponential time shift at mu of its own
    packed-token count (images of different sizes in one micro-batch get different sigmas for
    one u); static: flow.shift for all."""
    from loongforge.diffusion.config import QwenImageRunConfig
    from loongforge.diffusion.flow_matching import shift_sigma, train_sigma
    from loongforge.diffusion.task import QwenImageTask

    cfg = QwenImageRunConfig()
    task = QwenImageTask.__new__(QwenImageTask)
    task.cfg = cfg
    tokens = task.token_counts([torch.zeros(4, 1, 32, 32), torch.zeros(4, 1, 128, 192)])  # 512x512 and 1024x1536 images
    assert tokens == [256, 6144]
    u = torch.tensor([0.3, 0.3])
    torch.testing.assert_close(train_sigma(cfg.flow, u, tokens), shift_sigma(u, 1.0))  # the published recipe: unshifted
    cfg.flow.training_shift = "dynamic"
    got = train_sigma(cfg.flow, u, tokens)
    torch.testing.assert_close(got, exponential_shift(u, tokens), rtol=0, atol=1e-6)
    assert abs(got[0].item() - math.exp(0.5) * 0.3 / (1 + (math.exp(0.5) - 1) * 0.3)) < 1e-6  # mu = base_shift at 256 tokens
    assert got[1] - got[0] > 0.05  # the larger image trains noisier


@pytest.mark.parametrize("scheduler", ["euler", "unipc"])
def test_sampler_sigmas_equal_qwen_image_pipeline_at_two_sizes(scheduler):
    """`generate` on a Qwen-Image run (the shipped config): the scheduler is the published
    scheduler_config.json's, and the times the model sees and the sigmas it steps through equal
    QwenImagePipeline's for each image size (diffusers' calculate_shift and
    FlowMatchEulerDiscreteScheduler.set_timesteps(sigmas, mu) as the oracle)."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift
    from loongforge.core.recipes import resolve
    from loongforge.diffusion.generate import make_scheduler, sample_image_latents

    _, cfg = resolve("qwen_image_tiny", prefer="diffusion")

    class Recorder:  # the sampler's model: records the times it is called at, predicts zero velocity
        def __init__(self):
            self.cfg, self.times = SimpleNamespace(patch_size=2), []

        def __call__(self, rows, text, t, pack):
            self.times.append(t.item())
            return torch.zeros_like(rows)

    steps, text, got = 12, torch.zeros(3, cfg.model.joint_attention_dim), []
    for h, w in ((64, 64), (208, 116)):  # 512x512 and 1664x928 images: 1024 and 6032 packed tokens
        sched, model = make_scheduler(scheduler, cfg.flow), Recorder()
        if scheduler == "euler":
            assert {k: sched.config[k] for k in PUBLISHED_SCHEDULER} == PUBLISHED_SCHEDULER
        sample_image_latents(model, text, text, (4, 1, h, w), steps, 1.0, sched, torch.Generator().manual_seed(0), "cpu")
        oracle = FlowMatchEulerDiscreteScheduler.from_config(PUBLISHED_SCHEDULER)
        mu = calculate_shift((h // 2) * (w // 2), 256, 8192, 0.5, 0.9)
        oracle.set_timesteps(steps, sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
        if scheduler == "euler":  # QwenImagePipeline's scheduler: the same sigmas and times
            torch.testing.assert_close(sched.sigmas, oracle.sigmas, rtol=0, atol=1e-6)
            torch.testing.assert_close(torch.tensor(model.times), oracle.timesteps / 1000, rtol=0, atol=1e-6)
        else:  # UniPC on the same sigmas (its first at 1 - 1e-6, its times whole numbers)
            torch.testing.assert_close(sched.sigmas, oracle.sigmas, rtol=0, atol=2e-6)
            torch.testing.assert_close(torch.tensor(model.times), oracle.timesteps / 1000, rtol=0, atol=1e-3)
        got.append(sched.sigmas)
    assert (got[1][1:-2] - got[0][1:-2]).min() > 0.01  # the larger image samples noisier (both end at shift_terminal)


@pytest.mark.parametrize(
    "override,message",
    [
        ("flow.training_shift=size", "flow.training_shift='size': choose static (flow.shift) or dynamic"),
        ("flow.sampling_shift=auto", "flow.sampling_shift='auto': choose static (flow.shift) or dynamic"),
        ("flow.dynamic_shift.max_seq_len=256", "flow.dynamic_shift.base_seq_len=256 and flow.dynamic_shift.max_seq_len=256"),
        ("flow.dynamic_shift.max_shift=nan", "flow.dynamic_shift.max_shift=nan must be a finite number"),
        ("flow.dynamic_shift.shift_terminal=1.0", "flow.dynamic_shift.shift_terminal=1.0 must be in [0, 1)"),
    ],
)
def test_bad_shift_config_is_one_line(override, message):
    from loongforge.core.errors import UserError
    from loongforge.core.recipes import resolve
    from loongforge.diffusion.recipe import validate

    _, cfg = resolve("qwen_image_tiny", [override], prefer="diffusion")
    with pytest.raises(UserError) as e:
        validate(cfg)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


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
        ("parallel.context_parallel_size=3", "parallel.context_parallel_size=3 must divide model.num_attention_heads=4"),
        ("boundary_ratio=0.5", "boundary_ratio=0.5"),
        ("parallel.tensor_model_parallel_size=2", "parallel.stack=torch has data parallelism only"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, override, message):
    r = run_cli(["train", "qwen_image_tiny", "train.train_iters=1", f"checkpoint.run_dir={tmp_path}", override], module=MODULE)
    assert r.returncode == 2, r.stderr[-3000:]
    assert message in r.stderr.strip().splitlines()[-1]
