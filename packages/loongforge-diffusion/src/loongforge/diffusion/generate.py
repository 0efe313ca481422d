"""`loongforge-diffusion generate`: a video (mp4) or image (png) from a trained run.

The run's transformer (its EMA where it kept one) denoises Gaussian latents with Wan's
scheduler (diffusers' UniPCMultistepScheduler in flow-prediction mode at the run's shift, as
WanPipeline samples; or the flow-matching Euler scheduler, Qwen-Image's default as
QwenImagePipeline samples), classifier-free guidance against the negative prompt's text states,
then the run's frozen VAE decodes the latents. With `flow.sampling_shift: dynamic` (Qwen-Image)
the scheduler is built as the published Qwen/Qwen-Image scheduler_config.json builds it
(`use_dynamic_shifting`, exponential time shift, `shift_terminal`) and gets QwenImagePipeline's
sigmas and mu from the generated image's token count (`set_schedule`).

Wan2.1 image-to-video runs (`model.image_dim`) need `--image`: it is fitted to the frame
(`resize_crop`, as preprocessing fits training videos) and conditions every step as
`WanImageToVideoPipeline` does: the model's input is the latents concatenated with the
first-frame mask and the VAE latents of the image followed by zeros (`i2v_condition`), and the
image's CLIP features go to every cross-attention, for the prompt and the negative prompt alike.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from loongforge.core.errors import UserError
from loongforge.diffusion.flow_matching import calculate_shift
from loongforge.diffusion.models.wan import predict
from loongforge.diffusion.task import build_transformer, pad_text

SCHEDULERS = ("unipc", "euler")


def make_scheduler(name: str, flow):
    """diffusers' scheduler `name` for the run's flow config: at `flow.shift`, or (sampling_shift:
    dynamic) with the size-dependent shift's settings in its config, as Qwen/Qwen-Image's
    scheduler_config.json (use_dynamic_shifting, time_shift_type exponential, base / max image
    sequence length and shift, shift_terminal, shift 1); `set_schedule` then gives it mu."""
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    n = flow.num_train_timesteps
    dynamic, d = flow.sampling_shift == "dynamic", flow.dynamic_shift
    shift = 1.0 if dynamic else flow.shift
    kw = {"use_dynamic_shifting": True, "time_shift_type": "exponential", "shift_terminal": d.shift_terminal or None} if dynamic else {}
    seq = {"base_image_seq_len": d.base_seq_len, "max_image_seq_len": d.max_seq_len, "base_shift": d.base_shift, "max_shift": d.max_shift}
    if name == "unipc":
        sched = UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=n, flow_shift=shift, **kw
        )
        if dynamic:  # UniPC takes no such arguments; its config carries them as the pipeline reads them
            sched.register_to_config(**seq)
        return sched
    if name == "euler":
        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=n, shift=shift, **kw, **(seq if dynamic else {}))
    raise UserError(f"--scheduler={name!r}: choose one of {', '.join(SCHEDULERS)}")


def set_schedule(scheduler, steps: int, seq_len: int, device) -> None:
    """The scheduler's timesteps for `steps` steps of an image (or video) of `seq_len` patch
    tokens. A static scheduler: its own. One with `use_dynamic_shifting`: QwenImagePipeline's,
    sigmas linspace(1, 1/steps, steps) and mu = calculate_shift(seq_len, ...) of the scheduler's
    config (the pipeline's own fallbacks where a key is missing)."""
    c = scheduler.config
    if not c.get("use_dynamic_shifting", False):
        scheduler.set_timesteps(steps, device=device)
        return
    mu = calculate_shift(
        seq_len,
        c.get("base_image_seq_len", 256),
        c.get("max_image_seq_len", 4096),
        c.get("base_shift", 0.5),
        c.get("max_shift", 1.15),
    )
    scheduler.set_timesteps(steps, device=device, sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)


def latent_shape(vae, channels: int, frames: int, height: int, width: int, patch) -> tuple[int, int, int, int]:
    """The latents of a frames x height x width video, checked against the VAE's and the patch's
    strides (WanPipeline's `scale_factor_temporal` / `scale_factor_spatial`: 4x in time with
    frames = 4k + 1, 8x in space for Wan2.1's VAE, 16x for Wan2.2's)."""
    down = vae.config.temperal_downsample  # (Qwen-Image's VAE config names no scale factors: its pipeline's)
    ts = getattr(vae.config, "scale_factor_temporal", None) or 2 ** sum(down)
    ss = getattr(vae.config, "scale_factor_spatial", None) or 2 ** len(down)
    if frames < 1 or (frames - 1) % ts:
        raise UserError(f"--frames={frames}: must be {ts}k + 1 (1, {ts + 1}, {2 * ts + 1}, ...)")
    for name, v, p in (("--height", height, patch[1]), ("--width", width, patch[2])):
        if v < 1 or v % (ss * p):
            raise UserError(f"{name}={v}: must be a positive multiple of {ss * p} (the VAE's {ss}x times the patch's {p})")
    return channels, (frames - 1) // ts + 1, height // ss, width // ss


def i2v_condition(vae, image: torch.Tensor, frames: int, temporal: int) -> torch.Tensor:
    """Wan2.1 image-to-video's condition [temporal + C, F', h, w] of an image [3, H, W] in [-1, 1]
    for a video of `frames` frames: the first-frame mask and the normalized VAE latents of the
    image followed by zeros, as `WanImageToVideoPipeline.prepare_latents` returns them."""
    from loongforge.diffusion.data import condition_video, encode_video, first_frame_mask

    video = condition_video(image[:, None].expand(-1, frames, -1, -1))
    latents = encode_video(vae, video).float()
    _, f, h, w = latents.shape
    return torch.cat([first_frame_mask(f, h, w, temporal).to(latents.device), latents])


@torch.no_grad()
def sample_latents(
    model,
    cond: torch.Tensor,
    uncond: torch.Tensor,
    shape,
    steps: int,
    guidance: float,
    scheduler,
    generator,
    device,
    first_frame=None,
    condition=None,
    image_embeds=None,
):
    """Denoise Gaussian latents of `shape` in `steps` scheduler steps; cond / uncond: [1, L, D].
    `first_frame` [channels, 1, h, w]: the latents of a conditioning image, held as the first
    latent frame at time 0 (Wan2.2 TI2V's image-to-video, as WanPipeline's expand_timesteps).
    `condition` [mask + channels, F', h, w] and `image_embeds` [1, tokens, image_dim]: Wan2.1
    image-to-video's (`i2v_condition`, CLIP features), concatenated to the latents on the channel
    axis and attended to at every step (`WanImageToVideoPipeline.__call__`)."""
    latents = torch.randn(shape, generator=generator, dtype=torch.float32).to(device)[None]
    _, f, h, w = shape
    pt, ph, pw = model.cfg.patch_size
    set_schedule(scheduler, steps, (f // pt) * (h // ph) * (w // pw), device)
    for t in scheduler.timesteps:
        ts = t.expand(1).to(device)
        if first_frame is not None:
            latents[0, :, :1] = first_frame
            per_token = torch.full((f // pt, h // ph, w // pw), float(t), device=device)
            per_token[0] = 0.0
            ts = per_token.flatten()[None]
        x = latents if condition is None else torch.cat([latents, condition[None].to(latents)], dim=1)
        pred = predict(model, x, ts, cond, image_embeds)
        if guidance > 1.0:  # classifier-free guidance, as WanPipeline applies it
            base = predict(model, x, ts, uncond, image_embeds)
            pred = base + guidance * (pred - base)
        latents = scheduler.step(pred, t, latents, return_dict=False)[0]
    if first_frame is not None:
        latents[0, :, :1] = first_frame
    return latents[0]


@torch.no_grad()
def sample_image_latents(model, cond: torch.Tensor, uncond: torch.Tensor, shape, steps: int, guidance: float, scheduler, generator, device):
    """Qwen-Image: denoise image latents [channels, 1, h, w]; cond / uncond: the real text states
    [L, D] of the prompt and the negative prompt. Guidance as QwenImagePipeline's true CFG:
    uncond + g (cond - uncond), rescaled to the conditional prediction's norm per token."""
    from loongforge.diffusion.models.qwen_image import JointPack, pack_latents, unpack_latents

    c, _, h, w = shape
    p = model.cfg.patch_size
    latents = torch.randn(shape, generator=generator, dtype=torch.float32).to(device)
    set_schedule(scheduler, steps, (h // p) * (w // p), device)  # QwenImagePipeline's image_seq_len
    for t in scheduler.timesteps:
        rows = pack_latents(latents, p)

        def run(text):
            return model(rows, text, (t / 1000).expand(1).to(device), JointPack.of([(1, h // p, w // p)], [len(text)], device))

        pred = run(cond)
        if guidance > 1.0:
            base = run(uncond)
            mixed = base + guidance * (pred - base)
            pred = mixed * (pred.norm(dim=-1, keepdim=True) / mixed.norm(dim=-1, keepdim=True))
        step = scheduler.step(unpack_latents(pred, h, w, p)[None], t, latents[None], return_dict=False)[0]
        latents = step[0]
    return latents


def write_media(frames: np.ndarray, out: Path, fps: int) -> None:
    """uint8 [frames, H, W, 3] -> `out` (.mp4: H.264 in yuv420p; .png: one frame)."""
    import av
    from PIL import Image

    tmp = out.with_name(f".{out.name}.tmp{out.suffix}")
    if out.suffix == ".png":
        Image.fromarray(frames[0]).save(tmp)
    else:
        with av.open(str(tmp), "w") as container:
            stream = container.add_stream("libx264", rate=fps)
            stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
            for f in frames:
                for packet in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
    tmp.replace(out)


def generate(
    run_dir,
    prompt: str,
    out,
    frames: int = 9,
    height: int = 64,
    width: int = 64,
    steps: int = 20,
    guidance: float = 5.0,
    negative_prompt: str = "",
    seed: int = 0,
    scheduler: str | None = None,
    fps: int = 16,
    device: str = "cpu",
    ema: bool | None = None,
    image=None,
) -> Path:
    from loongforge.diffusion.data import encode_text, load_text_encoder, load_vae
    from loongforge.diffusion.model_io import read_trained
    from loongforge.diffusion.recipe import FROZEN, family

    run_dir, out = Path(run_dir), Path(out)
    if out.suffix not in (".mp4", ".png"):
        raise UserError(f"{out}: name an .mp4 (video) or .png (one frame) file")
    if out.exists():
        raise UserError(f"{out} exists; name a new file (generate never overwrites)")
    if out.suffix == ".png" and frames != 1:
        raise UserError(f"{out}: a .png holds one frame; pass --frames 1 or name an .mp4")
    if steps < 1 or guidance < 0:
        raise UserError(f"--steps={steps} must be at least 1 and --guidance={guidance} at least 0")
    cfg, state = read_trained(run_dir, ema, what="generate from")
    fam = family(cfg)
    if getattr(cfg.model, "image_dim", None) is not None and image is None:
        raise UserError(f"{run_dir} is an image-to-video run (model.image_dim): pass --image")
    if fam == "qwen_image" and (frames != 1 or image is not None):
        raise UserError("a Qwen-Image run generates images: pass --frames 1 (and no --image) and name a .png")
    if not (run_dir / FROZEN).is_file():
        raise UserError(f"{run_dir}: no {FROZEN} (the run was not started by `loongforge-diffusion train`)")
    frozen = json.loads((run_dir / FROZEN).read_text())
    model = build_transformer(cfg)  # two-expert runs pick the expert by each step's time
    model.load_state_dict(state, strict=True)
    model = model.float().to(device).eval()
    vae = load_vae(frozen["vae"], family=fam).to(device)
    tok, enc = load_text_encoder(frozen["text_encoder"], family=fam)
    texts = [encode_text(tok, enc, [p], family=fam)[0].to(device) for p in (prompt, negative_prompt)]
    # None: the family's pipeline's scheduler (WanPipeline: UniPC; QwenImagePipeline: Euler)
    sched = make_scheduler(scheduler or ("euler" if fam == "qwen_image" else "unipc"), cfg.flow)
    g = torch.Generator().manual_seed(seed)
    if fam == "qwen_image":
        p = cfg.model.patch_size
        shape = latent_shape(vae, cfg.model.in_channels // p**2, 1, height, width, (1, p, p))
        latents = sample_image_latents(model, *texts, shape, steps, guidance, sched, g, device)
        return _write_decoded(vae, latents, out, fps)
    i2v = cfg.model.image_dim is not None
    channels = cfg.model.out_channels if i2v else cfg.model.in_channels
    shape = latent_shape(vae, channels, frames, height, width, cfg.model.patch_size)
    cond, uncond = (pad_text([t], cfg.data.text_len) for t in texts)
    if i2v:  # Wan2.1 image-to-video: mask + condition latents beside the latents, CLIP features attended
        from loongforge.diffusion.data import encode_image, frame_image, load_image_encoder, read_image, resize_crop

        if not Path(image).is_file():
            raise UserError(f"--image={image}: no such file")
        if "image_encoder" not in frozen:
            raise UserError(f"{run_dir}: {FROZEN} names no image encoder")
        fitted = resize_crop(read_image(Path(image)), height, width)[:, 0]
        condition = i2v_condition(vae, fitted.to(device), frames, cfg.model.in_channels - 2 * channels)
        processor, clip = load_image_encoder(frozen["image_encoder"])
        embeds = encode_image(processor, clip.to(device), frame_image(fitted))[None].float()
        latents = sample_latents(model, cond, uncond, shape, steps, guidance, sched, g, device, condition=condition, image_embeds=embeds)
        return _write_decoded(vae, latents, out, fps)
    first = None
    if image is not None:  # image-to-video: the image, fitted to the frame, as the first latent frame
        from loongforge.diffusion.data import encode_video, read_image, resize_crop

        if not Path(image).is_file():
            raise UserError(f"--image={image}: no such file")
        first = encode_video(vae, resize_crop(read_image(Path(image)), height, width).to(device))
    latents = sample_latents(model, cond, uncond, shape, steps, guidance, sched, g, device, first)
    return _write_decoded(vae, latents, out, fps)


def _write_decoded(vae, latents, out: Path, fps: int) -> Path:
    from loongforge.diffusion.data import decode_latents

    video = decode_latents(vae, latents)  # [3, F, H, W] in [-1, 1]
    pixels = ((video.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 3, 0).cpu().numpy()
    out.parent.mkdir(parents=True, exist_ok=True)
    write_media(pixels, out, fps)
    return out
