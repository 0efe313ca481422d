"""`loongforge-diffusion train / generate / convert`: the shipped demo trains (loss falls), resume
gives the uninterrupted losses, 2 gloo processes equal one, the task's loss equals a by-hand
flow-matching loss on diffusers' model, and bad input is one line, exit 2."""

import json
import math

import pytest
import torch
from conftest import losses, run_cli
from loongforge.core.errors import UserError

MODULE = "loongforge.diffusion.cli"
SMALL = ["train.micro_batch_size=2", "train.global_batch_size=4", "train.log_interval=1", "data.demo.count=8"]


def train(args, nproc: int = 1):
    return run_cli(["train", "wan_tiny", *args], nproc=nproc, module=MODULE)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    d = tmp_path_factory.mktemp("straight")
    r = train([*SMALL, "train.train_iters=4", f"checkpoint.run_dir={d}"])
    assert r.returncode == 0, r.stderr[-3000:]
    return d


def test_demo_writes_its_run_dir(straight):
    got = losses(straight)
    assert sorted(got) == [1, 2, 3, 4] and all(math.isfinite(v) and v > 0 for v in got.values())
    assert (straight / "checkpoints" / "latest").read_text() == "step_00000004"
    frozen = json.loads((straight / "frozen.json").read_text())
    assert (straight / "frozen" / "vae" / "config.json").is_file() and frozen["vae"].endswith("vae")
    meta = json.loads((straight / "data" / "demo" / "latents" / "meta.json").read_text())
    assert meta["latent_channels"] == 4


def test_resume_gives_the_uninterrupted_losses(straight, tmp_path):
    first = train([*SMALL, "train.train_iters=2", f"checkpoint.run_dir={tmp_path}"])
    assert first.returncode == 0, first.stderr[-3000:]
    second = train([*SMALL, "train.train_iters=4", f"checkpoint.run_dir={tmp_path}"])
    assert second.returncode == 0, second.stderr[-3000:]
    assert "at step 2" in second.stdout, second.stdout[-2000:]
    want, got = losses(straight), losses(tmp_path)
    for step in (3, 4):
        assert abs(got[step] - want[step]) <= 1e-6 * abs(want[step]), (step, got[step], want[step])


@pytest.mark.slow
def test_two_gloo_processes_equal_one(straight, tmp_path):
    """DDP and FSDP2 (each rank half the samples) and Ulysses context parallel (both ranks every
    sample, each half of its tokens) give the one-process losses."""
    for mode, cp in (("ddp", 1), ("fsdp", 1), ("ddp", 2)):
        d = tmp_path / f"{mode}{cp}"
        extra = [f"parallel.data_parallel_mode={mode}", f"parallel.context_parallel_size={cp}"]
        r = train([*SMALL, "train.train_iters=4", *extra, f"checkpoint.run_dir={d}"], nproc=2)
        assert r.returncode == 0, r.stderr[-3000:]
        want, got = losses(straight), losses(d)
        assert sorted(got) == [1, 2, 3, 4]
        for step in want:
            assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), (mode, step, got[step], want[step])


def test_loss_falls_then_generate_and_convert(tmp_path):
    import av
    from diffusers import WanTransformer3DModel
    from loongforge.core.checkpoint.dcp_io import read_run
    from loongforge.diffusion.config import WanRunConfig
    from loongforge.diffusion.models.wan import WAN_TABLE

    run = tmp_path / "run"
    r = train(["train.train_iters=60", "train.log_interval=10", "data.demo.count=8", f"checkpoint.run_dir={run}"])
    assert r.returncode == 0, r.stderr[-3000:]
    got = losses(run)
    assert got[60] < 0.5 * got[10], got

    out = tmp_path / "clip.mp4"
    g = run_cli(["generate", str(run), "--prompt", "a red square moving right", "--out", str(out), "--steps", "3"], module=MODULE)
    assert g.returncode == 0, g.stderr[-3000:]
    with av.open(str(out)) as c:
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    assert len(frames) == 9 and frames[0].shape == (64, 64, 3)
    again = run_cli(["generate", str(run), "--prompt", "x", "--out", str(out)], module=MODULE)
    assert again.returncode == 2 and "exists" in again.stderr.strip().splitlines()[-1]
    png = tmp_path / "one.png"
    g = run_cli(["generate", str(run), "--prompt", "a blue circle", "--out", str(png), "--frames", "1", "--steps", "2"], module=MODULE)
    assert g.returncode == 0 and png.is_file(), g.stderr[-3000:]
    bad = run_cli(["generate", str(run), "--prompt", "x", "--out", str(tmp_path / "b.mp4"), "--frames", "8"], module=MODULE)
    assert bad.returncode == 2 and "--frames=8: must be 4k + 1" in bad.stderr.strip().splitlines()[-1]

    c = run_cli(["convert", str(run), str(tmp_path / "export")], module=MODULE)
    assert c.returncode == 0, c.stderr[-3000:]
    hf = WanTransformer3DModel.from_pretrained(tmp_path / "export").state_dict()
    _, state = read_run(run, WanRunConfig, "diffusion.wan")
    from loongforge.core.foundation.hf_mapping import lf_to_hf

    cfg = WanRunConfig().model.__class__.from_diffusers(json.loads((tmp_path / "export" / "config.json").read_text()))
    want = lf_to_hf(WAN_TABLE, state, cfg)
    assert set(want) == set(hf) and all(torch.equal(want[k], hf[k]) for k in hf)
    again = run_cli(["convert", str(run), str(tmp_path / "export")], module=MODULE)
    assert again.returncode == 2


def test_task_loss_equals_flow_matching_by_hand_on_diffusers_model():
    """One packed micro-batch of two sizes: the task's loss is the mean over samples of each
    sample's mean squared velocity error, diffusers' model predicting each sample alone."""
    from diffusers import WanTransformer3DModel
    from loongforge.core.foundation.hf_mapping import lf_to_hf
    from loongforge.diffusion.config import WanRunConfig
    from loongforge.diffusion.flow_matching import sample_u, shift_sigma
    from loongforge.diffusion.models.wan import WAN_TABLE
    from loongforge.diffusion.task import WanTask, pad_text

    cfg = WanRunConfig()
    cfg.flow.shift, cfg.flow.caption_dropout, cfg.data.text_len = 3.0, 0.5, 6
    items = [
        {"latents": torch.randn(4, 3, 4, 6), "text": torch.randn(5, cfg.model.text_dim)},
        {"latents": torch.randn(4, 1, 8, 4), "text": torch.randn(3, cfg.model.text_dim)},
    ]

    class Latents(list):
        meta = {"latent_channels": 4, "text_dim": cfg.model.text_dim}
        get = list.__getitem__

    ds = Latents(items)
    empty = torch.randn(1, cfg.model.text_dim)
    task = WanTask(cfg, ds, empty, 0, 1, torch.device("cpu"), None)
    torch.manual_seed(0)
    model = task.build_model()
    mb = {"latents": [it["latents"] for it in items], "text": [it["text"] for it in items], "seed": 1234}
    with torch.no_grad():
        total, weight, _ = task.loss(model, mb)

    ref = WanTransformer3DModel(**{k: v for k, v in cfg.model.diffusers_config().items() if not k.startswith("_")})
    ref.load_state_dict(lf_to_hf(WAN_TABLE, model.state_dict(), cfg.model))
    g = torch.Generator().manual_seed(1234)
    sigma = shift_sigma(sample_u(cfg.flow, 2, g, "cpu"), 3.0)
    drop = torch.rand(2, generator=g) < 0.5
    texts = [empty if d else it["text"] for d, it in zip(drop.tolist(), items)]
    want = []
    for it, s, t in zip(items, sigma, texts):
        x0 = it["latents"]
        noise = torch.randn(x0.shape, generator=g)
        with torch.no_grad():
            pred = ref((1 - s) * x0[None] + s * noise[None], (s * 1000)[None], pad_text([t], 6), return_dict=False)[0][0]
        want.append((pred - (noise - x0)).square().mean())
    assert weight.item() == 2.0
    assert abs(total.item() - sum(want).item()) <= 1e-5 * abs(sum(want).item())


def test_first_frame_conditioning_equals_diffusers_ti2v_by_hand():
    """Wan2.2 TI2V: a conditioned sample keeps its first latent frame clean, its tokens get time 0
    (diffusers' per-token `[batch, tokens]` timesteps, as WanPipeline's expand_timesteps) and
    stay out of the loss; an unconditioned sample in the same pack trains as text-to-video."""
    from diffusers import WanTransformer3DModel
    from loongforge.core.foundation.hf_mapping import lf_to_hf
    from loongforge.diffusion.config import WanRunConfig
    from loongforge.diffusion.flow_matching import sample_u, shift_sigma
    from loongforge.diffusion.models.wan import WAN_TABLE
    from loongforge.diffusion.task import WanTask, pad_text

    cfg = WanRunConfig()
    cfg.flow.shift, cfg.flow.caption_dropout, cfg.flow.first_frame_condition, cfg.data.text_len = 3.0, 0.0, 0.5, 6
    items = [
        {"latents": torch.randn(4, 3, 4, 6), "text": torch.randn(5, cfg.model.text_dim)},
        {"latents": torch.randn(4, 2, 4, 4), "text": torch.randn(3, cfg.model.text_dim)},
    ]

    class Latents(list):
        meta = {"latent_channels": 4, "text_dim": cfg.model.text_dim}
        get = list.__getitem__

    task = WanTask(cfg, Latents(items), torch.zeros(1, cfg.model.text_dim), 0, 1, torch.device("cpu"), None)
    torch.manual_seed(0)
    model = task.build_model()
    seed = 0
    g = torch.Generator().manual_seed(seed)
    sigma = shift_sigma(sample_u(cfg.flow, 2, g, "cpu"), 3.0)
    torch.rand(2, generator=g)  # caption dropout's draw
    cond = (torch.rand(2, generator=g) < 0.5).tolist()
    assert cond == [True, False]  # (this seed conditions the first sample only)
    mb = {"latents": [it["latents"] for it in items], "text": [it["text"] for it in items], "seed": seed}
    with torch.no_grad():
        total, weight, _ = task.loss(model, mb)

    ref = WanTransformer3DModel(**{k: v for k, v in cfg.model.diffusers_config().items() if not k.startswith("_")})
    ref.load_state_dict(lf_to_hf(WAN_TABLE, model.state_dict(), cfg.model))
    want = []
    for it, s, c in zip(items, sigma, cond):
        x0 = it["latents"]
        noise = torch.randn(x0.shape, generator=g)
        x_t = (1 - s) * x0 + s * noise
        t = torch.full(x0.shape[1:], float(s * 1000))
        if c:
            x_t[:, 0], t[0] = x0[:, 0], 0.0
        t = t[:, ::2, ::2].flatten()[None]  # one time per patch token
        with torch.no_grad():
            pred = ref(x_t[None], t, pad_text([it["text"]], 6), return_dict=False)[0][0]
        err = (pred - (noise - x0)).square()
        want.append(err[:, 1:].mean() if c else err.mean())
    assert weight.item() == 2.0
    assert abs(total.item() - sum(want).item()) <= 1e-5 * abs(sum(want).item())


def test_i2v_config_checks():
    """wan_i2v_tiny validates; what image-to-video does not support is refused by name."""
    from loongforge.core.config import load_config
    from loongforge.diffusion.config import CONFIG_DIR, WanRunConfig
    from loongforge.diffusion.recipe import validate

    def cfg(**changes):
        c = load_config(WanRunConfig, CONFIG_DIR / "wan_i2v_tiny.yaml")
        for key, value in changes.items():
            section, name = key.split("__")
            setattr(getattr(c, section), name, value)
        return c

    validate(cfg())
    for changes, message in (
        ({"frozen__image_encoder": None}, "needs frozen.image_encoder"),
        ({"data__text_len": 32}, "data.text_len=32: image-to-video"),
        ({"parallel__context_parallel_size": 3}, "parallel.context_parallel_size=3 must divide model.num_attention_heads=4"),
        ({"flow__first_frame_condition": 0.5}, "flow.first_frame_condition=0.5: not supported for image-to-video"),
    ):
        with pytest.raises(UserError, match=message):
            validate(cfg(**changes))
    c = cfg()
    c.boundary_ratio = 0.5
    with pytest.raises(UserError, match="boundary_ratio=0.5: not supported for image-to-video"):
        validate(c)


def test_i2v_task_loss_equals_diffusers_i2v_pipeline_conditioning_by_hand():
    """Wan2.1 image-to-video: the task's loss (preprocessed condition latents and CLIP features, its
    own mask) equals the flow-matching loss of diffusers' I2V WanTransformer3DModel fed the noisy
    latents concatenated with what `WanImageToVideoPipeline.prepare_latents` builds from the first
    frame (mask + condition latents; generate's `i2v_condition` builds the same) and
    `encode_image`'s CLIP features; only the latents are noised and predicted."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline, WanTransformer3DModel
    from loongforge.core.foundation.hf_mapping import lf_to_hf
    from loongforge.diffusion.config import WanRunConfig
    from loongforge.diffusion.data import (
        condition_video,
        encode_image,
        encode_video,
        frame_image,
        load_image_encoder,
        load_text_encoder,
        load_vae,
    )
    from loongforge.diffusion.flow_matching import sample_u, shift_sigma
    from loongforge.diffusion.generate import i2v_condition
    from loongforge.diffusion.models.wan import WAN_TABLE
    from loongforge.diffusion.task import WanTask, pad_text

    cfg = WanRunConfig()
    cfg.model.in_channels, cfg.model.image_dim, cfg.model.added_kv_proj_dim = 12, 16, cfg.model.hidden_size
    cfg.flow.shift, cfg.flow.caption_dropout = 3.0, 0.5  # data.text_len: 512, as diffusers' I2V model needs
    vae, (processor, clip) = load_vae("tiny"), load_image_encoder("tiny")
    g0 = torch.Generator().manual_seed(0)
    videos = [torch.randint(0, 256, (3, f, h, w), generator=g0) / 127.5 - 1 for f, h, w in ((9, 32, 32), (5, 32, 48))]
    items = [
        {
            "latents": encode_video(vae, v),
            "text": torch.randn(n, cfg.model.text_dim),
            "condition": encode_video(vae, condition_video(v)),
            "image": encode_image(processor, clip, frame_image(v[:, 0])),
        }
        for v, n in zip(videos, (5, 3))
    ]

    class Latents(list):
        meta = {"latent_channels": 4, "text_dim": cfg.model.text_dim, "image_dim": 16}
        get = list.__getitem__

    empty = torch.randn(1, cfg.model.text_dim)
    task = WanTask(cfg, Latents(items), empty, 0, 1, torch.device("cpu"), None)
    torch.manual_seed(0)
    model = task.build_model()
    mb = {k: [it[k] for it in items] for k in ("latents", "text", "condition", "image")} | {"seed": 99}
    with torch.no_grad():
        total, weight, _ = task.loss(model, mb)

    ref = WanTransformer3DModel(**{k: v for k, v in cfg.model.diffusers_config().items() if not k.startswith("_")})
    ref.load_state_dict(lf_to_hf(WAN_TABLE, model.state_dict(), cfg.model))
    tok, enc = load_text_encoder("tiny")
    pipe = WanImageToVideoPipeline(tok, enc, vae, FlowMatchEulerDiscreteScheduler(), processor, clip, ref)
    g = torch.Generator().manual_seed(99)
    sigma = shift_sigma(sample_u(cfg.flow, 2, g, "cpu"), 3.0)
    drop = torch.rand(2, generator=g) < 0.5
    texts = [empty if d else it["text"] for d, it in zip(drop.tolist(), items)]
    want = []
    for v, it, s, t in zip(videos, items, sigma, texts):
        x0 = it["latents"]
        noise = torch.randn(x0.shape, generator=g)
        _, f, h, w = v.shape
        x_t, condition = pipe.prepare_latents(
            v[None, :, 0], 1, 4, h, w, f, torch.float32, "cpu", None, (1 - s) * x0[None] + s * noise[None]
        )
        assert torch.allclose(condition[0], torch.cat([task.mask(x0), it["condition"]]), atol=1e-6)  # the pipeline's mask + latents
        assert torch.allclose(condition[0], i2v_condition(vae, v[:, 0], f, 4), atol=1e-6)  # generate's, from the image alone
        image = pipe.encode_image(frame_image(v[:, 0]), "cpu")
        assert torch.allclose(image[0], it["image"], atol=1e-6)
        with torch.no_grad():
            pred = ref(torch.cat([x_t, condition], dim=1), (s * 1000)[None], pad_text([t], 512), image, return_dict=False)[0][0]
        assert pred.shape == x0.shape  # the latents' channels only
        want.append((pred - (noise - x0)).square().mean())
    assert weight.item() == 2.0
    assert abs(total.item() - sum(want).item()) <= 1e-5 * abs(sum(want).item())


def test_i2v_demo_trains_then_generates_from_an_image(tmp_path, capsys):
    """The shipped wan_i2v_tiny (tiny CLIP image encoder) trains a few steps on its demo, keeps the
    frozen encoders out of the checkpoint, and generates from --image (required for an I2V run)."""
    import av
    from loongforge.core.checkpoint.dcp_io import read_run
    from loongforge.diffusion.config import WanRunConfig
    from PIL import Image

    run = tmp_path / "run"
    small = ["train.micro_batch_size=2", "train.global_batch_size=2", "train.log_interval=1", "data.demo.count=2", "data.demo.frames=5"]
    r = run_cli(
        ["train", "wan_i2v_tiny", *small, "train.train_iters=2", "data.demo.height=32", "data.demo.width=32", f"checkpoint.run_dir={run}"],
        module=MODULE,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(losses(run)) == [1, 2] and all(math.isfinite(v) for v in losses(run).values())
    frozen = json.loads((run / "frozen.json").read_text())
    assert (run / "frozen" / "image_encoder" / "config.json").is_file() and frozen["image_encoder"] == str(run / "frozen")
    meta = json.loads((run / "data" / "demo" / "latents" / "meta.json").read_text())
    assert (meta["image_encoder"], meta["image_dim"]) == ("tiny", 16)
    _, state = read_run(run, WanRunConfig, "diffusion.wan")
    assert "image_in.fc1.weight" in state and not any(k.startswith(("vae", "image_encoder", "text_encoder")) for k in state)

    Image.new("RGB", (40, 32), (200, 30, 30)).save(tmp_path / "first.png")
    out = tmp_path / "clip.mp4"
    args = ["--prompt", "a red square", "--height", "32", "--width", "32", "--frames", "5", "--steps", "2"]
    from loongforge.diffusion.cli import main  # in process: the command line parsed as a user's would be

    assert main(["generate", str(run), *args, "--image", str(tmp_path / "first.png"), "--out", str(out)]) == 0
    with av.open(str(out)) as c:
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    assert len(frames) == 5 and frames[0].shape == (32, 32, 3)
    capsys.readouterr()
    assert main(["generate", str(run), *args, "--out", str(tmp_path / "b.mp4")]) == 2
    assert "image-to-video run (model.image_dim): pass --image" in capsys.readouterr().err.strip().splitlines()[-1]


def test_image_to_video_sampling_holds_the_first_frame():
    """TI2V sampling: the conditioning image's latents stay the first latent frame at every step
    (the model sees them at time 0), the other frames are sampled."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from loongforge.diffusion.generate import sample_latents
    from loongforge.diffusion.models.wan import WanConfig, WanDiT

    torch.manual_seed(0)
    model = WanDiT(WanConfig()).eval()
    first = torch.randn(4, 1, 4, 6)
    cond, uncond = torch.randn(1, 5, 32), torch.zeros(1, 5, 32)
    out = sample_latents(
        model,
        cond,
        uncond,
        (4, 3, 4, 6),
        3,
        2.0,
        FlowMatchEulerDiscreteScheduler(shift=3.0),
        torch.Generator().manual_seed(1),
        "cpu",
        first,
    )
    assert torch.equal(out[:, :1], first)
    free = sample_latents(
        model, cond, uncond, (4, 3, 4, 6), 3, 2.0, FlowMatchEulerDiscreteScheduler(shift=3.0), torch.Generator().manual_seed(1), "cpu"
    )
    assert not torch.allclose(free[:, 1:], out[:, 1:])  # the condition changes what is sampled


def test_flow_matching_schedule():
    from loongforge.diffusion.flow_matching import FlowMatchingConfig, loss_weight, sample_u, shift_sigma

    u = torch.tensor([0.0, 0.25, 0.5, 1.0])
    torch.testing.assert_close(shift_sigma(u, 1.0), u)
    torch.testing.assert_close(shift_sigma(u, 3.0), torch.tensor([0.0, 0.5, 0.75, 1.0]))
    s = torch.tensor([0.5])
    torch.testing.assert_close(loss_weight(FlowMatchingConfig(loss_weighting="cosmap"), s), torch.tensor([2 / (math.pi * 0.5)]))
    torch.testing.assert_close(loss_weight(FlowMatchingConfig(loss_weighting="sigma_sqrt"), s), torch.tensor([4.0]))
    draws = sample_u(FlowMatchingConfig(timestep_sampling="logit_normal"), 20000, torch.Generator().manual_seed(0), "cpu")
    assert 0 < draws.min() and draws.max() < 1 and abs(draws.median().item() - 0.5) < 0.02


@pytest.mark.parametrize(
    "override,message",
    [
        ("parallel.tensor_model_parallel_size=2", "parallel.stack=torch has data parallelism only"),
        ("data.root=/nonexistent/latents", "not a preprocessed latent directory"),
        ("flow.timestep_sampling=beta", "flow.timestep_sampling='beta': choose one of"),
        ("flow.shift=0", "flow.shift=0.0 must be positive"),
        ("model.in_channels=8", "but model.in_channels=8"),
        ("checkpoint.load=/nonexistent/wan", "expected a diffusers transformer directory"),
        ("parallel.context_parallel_size=3", "must divide model.num_attention_heads=4"),
        ("frozen.image_encoder=tiny", "only an image-to-video model (model.image_dim) takes one"),
        ("flow.first_frame_condition=1.5", "flow.first_frame_condition=1.5 must be in [0, 1]"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, override, message):
    r = train([*SMALL, "train.train_iters=1", f"checkpoint.run_dir={tmp_path}", override])
    assert r.returncode == 2, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert message in last, last
    assert "Traceback" not in r.stderr


def test_preprocess_cli_then_train_on_its_output(tmp_path):
    """The real data path: `preprocess` a captioned folder (with one missing video, skipped and
    counted), then train on the latent directory it wrote."""
    from loongforge.diffusion.data import write_demo_videos

    src = write_demo_videos(tmp_path / "clips", count=4, frames=5, height=32, width=32)
    with open(src / "captions.jsonl", "a") as f:
        f.write(json.dumps({"video": "videos/missing.mp4", "caption": "gone"}) + "\n")
    r = run_cli(["preprocess", str(src), str(tmp_path / "latents"), "--buckets", "32x32x5", "--fps", "0"], module=MODULE)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["samples"] == 4 and summary["bad"] == {"missing": 1}
    run = tmp_path / "run"
    t = train(
        [
            "train.train_iters=2",
            "train.micro_batch_size=2",
            "train.global_batch_size=2",
            f"data.root={tmp_path / 'latents'}",
            f"checkpoint.run_dir={run}",
        ]
    )
    assert t.returncode == 0, t.stderr[-3000:]
    assert max(losses(run)) == 2


def test_shipped_published_config_is_wan21_t2v_1p3b():
    from loongforge.core.config import load_config
    from loongforge.diffusion.config import CONFIG_DIR, WanRunConfig

    cfg = load_config(WanRunConfig, CONFIG_DIR / "wan2.1_t2v_1.3b.yaml")
    published = {  # Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer/config.json
        "patch_size": [1, 2, 2], "num_attention_heads": 12, "attention_head_dim": 128, "in_channels": 16, "out_channels": 16,
        "text_dim": 4096, "freq_dim": 256, "ffn_dim": 8960, "num_layers": 30, "cross_attn_norm": True, "eps": 1e-6,
        "qk_norm": "rms_norm_across_heads", "rope_max_seq_len": 1024, "image_dim": None, "added_kv_proj_dim": None,
    }  # fmt: skip
    assert type(cfg.model).from_diffusers({"_class_name": "WanTransformer3DModel", **published}) == cfg.model


@pytest.mark.slow
def test_two_experts_train_on_two_gloo_processes_as_on_one(tmp_path):
    """Wan2.2 A14B's two transformers in one run: FSDP2 on 2 gloo processes (whose samples go to
    different experts) gives the one-process losses; both experts train; the export holds
    transformer/ and transformer_2/ and starts a new run (checkpoint.load) with those weights."""
    from loongforge.core.checkpoint.dcp_io import read_run
    from loongforge.diffusion.config import WanRunConfig

    experts = [*SMALL, "train.train_iters=3", "boundary_ratio=0.5"]
    one, two = tmp_path / "one", tmp_path / "two"
    r = train([*experts, f"checkpoint.run_dir={one}"])
    assert r.returncode == 0, r.stderr[-3000:]
    r = train([*experts, "parallel.data_parallel_mode=fsdp", f"checkpoint.run_dir={two}"], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    want, got = losses(one), losses(two)
    for step in want:
        assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), (step, got[step], want[step])
    _, state = read_run(one, WanRunConfig, "diffusion.wan")
    assert {k.split(".", 1)[0] for k in state} == {"high", "low"}

    c = run_cli(["convert", str(one), str(tmp_path / "export")], module=MODULE)
    assert c.returncode == 0, c.stderr[-3000:]
    assert (tmp_path / "export" / "transformer" / "config.json").is_file() and (
        tmp_path / "export" / "transformer_2" / "config.json"
    ).is_file()
    again = tmp_path / "again"
    r = train([*experts, "train.train_iters=1", "train.lr=0", f"checkpoint.load={tmp_path / 'export'}", f"checkpoint.run_dir={again}"])
    assert r.returncode == 0, r.stderr[-3000:]
    _, back = read_run(again, WanRunConfig, "diffusion.wan", ema=False)
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_wan22_vae_latent_layout(tmp_path):
    """Wan2.2's VAE (TI2V-5B's: 2x2 pixel patches in, residual, 16x in space): preprocessing,
    training and generation follow its strides; a bucket its latents cannot patch is refused."""
    import av
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    AutoencoderKLWan(
        base_dim=8, decoder_base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, is_residual=True, patch_size=2,
        in_channels=12, out_channels=12, scale_factor_spatial=16, latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
    ).save_pretrained(tmp_path / "vae")  # fmt: skip
    run = tmp_path / "run"
    args = [
        "train.train_iters=2",
        "train.micro_batch_size=2",
        "train.global_batch_size=2",
        "data.demo.count=4",
        f"frozen.vae={tmp_path / 'vae'}",
    ]
    r = train([*args, f"checkpoint.run_dir={run}"])
    assert r.returncode == 0, r.stderr[-3000:]
    meta = json.loads((run / "data" / "demo" / "latents" / "shards" / "00000.json").read_text())
    assert meta["samples"][0]["latent_shape"] == [4, 3, 4, 4]  # 9 x 64 x 64 at 4x / 16x
    out = tmp_path / "v.mp4"
    g = run_cli(["generate", str(run), "--prompt", "a red square", "--out", str(out), "--steps", "2"], module=MODULE)
    assert g.returncode == 0, g.stderr[-3000:]
    with av.open(str(out)) as c:
        assert len([f for f in c.decode(video=0)]) == 9
    from PIL import Image

    Image.new("RGB", (80, 64), (200, 30, 30)).save(tmp_path / "first.png")  # fitted (cropped) to 64 x 64
    g = run_cli(
        [
            "generate",
            str(run),
            "--prompt",
            "a red square",
            "--image",
            str(tmp_path / "first.png"),
            "--out",
            str(tmp_path / "i.mp4"),
            "--steps",
            "2",
        ],
        module=MODULE,
    )
    assert g.returncode == 0 and (tmp_path / "i.mp4").is_file(), g.stderr[-3000:]
    bad = run_cli(["generate", str(run), "--prompt", "x", "--out", str(tmp_path / "b.mp4"), "--height", "48"], module=MODULE)
    assert bad.returncode == 2 and "--height=48: must be a positive multiple of 32" in bad.stderr.strip().splitlines()[-1]
    r = train([*args, "data.demo.height=48", "data.demo.width=48", f"checkpoint.run_dir={tmp_path / 'odd'}"])
    assert r.returncode == 2 and "not divisible by model.patch_size=[1, 2, 2]" in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]
