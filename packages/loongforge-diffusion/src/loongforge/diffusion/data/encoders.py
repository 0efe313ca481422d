"""The frozen encoders of a family's training, loaded from a directory or built tiny and random for
demos and tests:
- "wan" (Wan2.1 / 2.2 text-to-video, the default everywhere): the video VAE (diffusers'
  `AutoencoderKLWan`) and the UMT5 text encoder (transformers' `UMT5EncoderModel`);
- "qwen_image" (Qwen-Image text-to-image): diffusers' `AutoencoderKLQwenImage` (images are
  one-frame videos) and transformers' `Qwen2_5_VLForConditionalGeneration` as text encoder.

A spec is a directory or "tiny":
- VAE: a directory holding `AutoencoderKLWan.save_pretrained` output (config.json and weights), or
  a diffusers pipeline directory (e.g. Wan-AI/Wan2.1-T2V-1.3B-Diffusers) with it in `vae/`.
  "tiny" is TINY_VAE_CONFIG: base_dim 8, dim_mult [1, 1, 1, 1], one residual block per level,
  z_dim 4, Wan's temporal downsampling [False, True, True] (F = 4k + 1 frames -> k + 1 latent
  frames) and 8x spatial downsampling, latents_mean 0 and latents_std 1 per channel; a 9 x 32 x 32
  video becomes latents [4, 3, 4, 4].
- Text encoder: a directory holding a `UMT5EncoderModel` and its tokenizer, or a diffusers pipeline
  directory with them in `text_encoder/` and `tokenizer/`. "tiny" is a UMT5EncoderModel of
  d_model 32, 2 layers, 4 heads, d_kv 8, d_ff 64 over the shipped tiny tokenizer of
  loongforge-core (`load_tokenizer("tiny")`).
- Qwen-Image: a directory's classes come from its config.json (the VAE's `_class_name`
  "AutoencoderKLQwenImage"; the text encoder's `architectures` / `model_type`
  "Qwen2_5_VLForConditionalGeneration" / "qwen2_5_vl"), so `family` only matters for "tiny" and
  for `encode_text`; anything else loads as the Wan class, as before. "tiny" with
  family="qwen_image" is TINY_QWEN_VAE_CONFIG (the Wan tiny VAE's sizes: a 1 x 32 x 32 image
  becomes latents [4, 1, 4, 4]) and a Qwen2_5_VLForConditionalGeneration of TINY_QWEN_TEXT_CONFIG
  (text hidden size 24, 2 layers, 2 heads, 1 KV head, head_dim 12, mrope_section [2, 2, 2]; a one-
  block vision tower of width 16) over the same shipped tiny tokenizer (vocabulary size from it).
- Image encoder (Wan2.1 image-to-video only): a diffusers I2V pipeline directory (e.g.
  Wan-AI/Wan2.1-I2V-14B-480P-Diffusers) with `image_encoder/` (a `CLIPVisionModel`) and
  `image_processor/` (its `CLIPImageProcessor`), or a `CLIPVisionModel` directory holding its
  preprocessor_config.json. "tiny" is a CLIPVisionModel of TINY_CLIP_CONFIG (hidden size 16, 2
  layers, 2 heads, 32 x 32 images in 8 x 8 patches: 17 tokens) with a CLIPImageProcessor at 32
  pixels (CLIP's mean / std). `encode_image` computes `WanImageToVideoPipeline.encode_image`: the
  processor's pixels, the encoder's penultimate hidden states (`output_hidden_states=True`,
  `hidden_states[-2]`).
Tiny weights come from `torch.manual_seed(0)` (inside `torch.random.fork_rng`, so the caller's
RNG is untouched): two calls give identical models. Every model is returned in eval mode with
requires_grad False.

Latents are normalized per channel as diffusers' Wan pipelines do: `(z - latents_mean) *
(1 / latents_std)` from the VAE config (`WanImageToVideoPipeline.prepare_latents`), and
`z / (1 / latents_std) + latents_mean` before `vae.decode` (`WanPipeline.__call__`). `encode_video`
takes the posterior's mean (`latent_dist.mode()`, what the Wan pipelines use for conditioning
latents, "argmax"): deterministic, no sampling noise.

`encode_text` computes exactly what `WanPipeline._get_t5_prompt_embeds` computes before it pads:
the same prompt cleaning (diffusers' `prompt_clean`), the same tokenizer call (padding to
`max_length`, truncation, special tokens, attention mask), the encoder run on ids and mask, each
row cut to its number of real tokens.

Qwen-Image (diffusers' `QwenImagePipeline` and its img2img / edit variants) normalizes latents the
same way: `_encode_vae_image` computes `(z - latents_mean) * (1 / latents_std)` (the edit
pipelines take `latent_dist.mode()`, "argmax", as `encode_video` does), and `__call__` decodes
`z / (1 / latents_std) + latents_mean` with `vae.decode(...)[0][:, :, 0]` (one frame). So
`encode_video` / `decode_latents` serve both VAEs unchanged. Its text states
(`QwenImagePipeline._get_qwen_prompt_embeds`): each caption formatted into the chat template
QWEN_PROMPT_TEMPLATE (no prompt cleaning), tokenized as a batch (`padding=True`, `truncation=True`,
`max_length` 1024 + 34), the encoder's last hidden state (`output_hidden_states=True`,
`hidden_states[-1]`), each row's real tokens (by the attention mask) less the first 34 (the
template's system part, `prompt_template_encode_start_idx`); `encode_prompt` then keeps the first
`max_sequence_length` of them (512 in `__call__`): `encode_text(..., family="qwen_image")` returns
exactly these rows, before the pipeline pads them into a batch.
"""

from __future__ import annotations

from pathlib import Path

import torch
from loongforge.core.errors import UserError

TINY = "tiny"
TINY_VAE_CONFIG = {
    "base_dim": 8,
    "z_dim": 4,
    "dim_mult": [1, 1, 1, 1],
    "num_res_blocks": 1,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "latents_mean": [0.0, 0.0, 0.0, 0.0],
    "latents_std": [1.0, 1.0, 1.0, 1.0],
}
TINY_TEXT_CONFIG = {"d_model": 32, "num_layers": 2, "num_heads": 4, "d_kv": 8, "d_ff": 64}
TINY_CLIP_CONFIG = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": 32,
    "patch_size": 8,
}
DEFAULT_MAX_LENGTH = 512  # Wan2.1's text length (WanPipeline.__call__'s max_sequence_length)

FAMILIES = ("wan", "qwen_image")
QWEN_VAE_CLASS = "AutoencoderKLQwenImage"
QWEN_TEXT_CLASS = "Qwen2_5_VLForConditionalGeneration"
QWEN_TEXT_MODEL_TYPE = "qwen2_5_vl"
TINY_QWEN_VAE_CONFIG = TINY_VAE_CONFIG  # AutoencoderKLQwenImage takes the same arguments
# Qwen2_5_VLConfig's text_config (vocab_size and the special token ids come from the tokenizer) and
# vision_config: head_dim = 24 / 2 = 12, so mrope_section sums to 6.
TINY_QWEN_TEXT_CONFIG = {
    "hidden_size": 24,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 2048,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2, 2]},
}
TINY_QWEN_VISION_CONFIG = {
    "depth": 1,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_heads": 2,
    "out_hidden_size": 24,
    "fullatt_block_indexes": [0],
}
# QwenImagePipeline.__init__'s prompt_template_encode / prompt_template_encode_start_idx /
# tokenizer_max_length, and check_inputs' limit on max_sequence_length
QWEN_PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
QWEN_PROMPT_DROP = 34
QWEN_TOKENIZER_MAX_LENGTH = 1024


def spec_key(spec) -> str:
    """How a spec is recorded: "tiny", or the directory's absolute path."""
    return TINY if str(spec) == TINY else str(Path(spec).resolve())


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _frozen(model):
    model.eval()
    model.requires_grad_(False)
    return model


def check_family(family: str) -> str:
    """`family` if it is one of FAMILIES, else a UserError."""
    if family not in FAMILIES:
        raise UserError(f"family {family!r}: expected one of {', '.join(FAMILIES)}")
    return family


def _read_config(path: Path) -> dict:
    """A config.json as a dict; {} when it is unreadable (the loader then reports the error)."""
    import json

    try:
        value = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _transformers_dtype_kwarg(dtype) -> dict:
    """`dtype=` for transformers >= 4.56, `torch_dtype=` before."""
    import transformers

    major, minor = (int(v) for v in transformers.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


# ---- VAE -----------------------------------------------------------------------------------------


def vae_dir(spec) -> tuple[Path, str | None]:
    """(directory, subfolder) holding the VAE of directory spec `spec`; a UserError if none."""
    p = Path(spec)
    if (p / "vae" / "config.json").is_file():
        return p, "vae"
    if (p / "config.json").is_file():
        return p, None
    raise UserError(
        f"VAE not found: {spec} (need an AutoencoderKLWan or AutoencoderKLQwenImage directory with config.json, a diffusers pipeline "
        "directory with vae/, or 'tiny')"
    )


def load_vae(spec: str, dtype=torch.float32, family: str = "wan"):
    """The frozen VAE of `spec` (see the module docstring) in `dtype`, on the CPU: an
    `AutoencoderKLWan`, or an `AutoencoderKLQwenImage` for a directory whose config names that
    class or for "tiny" with family="qwen_image"."""
    from diffusers import AutoencoderKLQwenImage, AutoencoderKLWan

    check_family(family)
    if str(spec) == TINY:
        cls, config = (AutoencoderKLQwenImage, TINY_QWEN_VAE_CONFIG) if family == "qwen_image" else (AutoencoderKLWan, TINY_VAE_CONFIG)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            vae = cls(**config)
        if dtype != vae.dtype:
            vae = vae.to(dtype)
        return _frozen(vae)
    path, subfolder = vae_dir(spec)
    config = _read_config(path / (subfolder or "") / "config.json")
    cls = AutoencoderKLQwenImage if config.get("_class_name") == QWEN_VAE_CLASS else AutoencoderKLWan
    try:
        vae = cls.from_pretrained(str(path), subfolder=subfolder, torch_dtype=dtype)
    except Exception as e:  # diffusers raises many types for unreadable or mismatched files
        raise UserError(f"cannot load the VAE from {path / (subfolder or '')}: {_first_line(e)}") from None
    return _frozen(vae)


def vae_latent_stats(vae) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std), float32 [z_dim], from `vae.config.latents_mean` / `latents_std`; zeros / ones
    where the config has none. A UserError when their length is not z_dim (diffusers' Wan
    pipelines would fail on such a VAE too)."""
    z = int(vae.config.z_dim)
    out = []
    for name, default in (("latents_mean", 0.0), ("latents_std", 1.0)):
        values = getattr(vae.config, name, None)
        if values is None:
            out.append(torch.full((z,), default, dtype=torch.float32))
            continue
        if len(values) != z:
            raise UserError(f"VAE config: {name} has {len(values)} values, z_dim is {z}")
        out.append(torch.tensor(values, dtype=torch.float32))
    return out[0], out[1]


def _device(module) -> torch.device:
    return next(module.parameters()).device


def encode_video(vae, video: torch.Tensor) -> torch.Tensor:
    """Normalized latents [C, F', H', W'] (F' = (F - 1) / 4 + 1, H' = H / 8, W' = W / 8) of one
    video [3, F, H, W] in [-1, 1]: the posterior's mean (`latent_dist.mode()`, no sampling), then
    `(z - latents_mean) * (1 / latents_std)` as the Wan pipelines compute it (and the Qwen-Image
    ones, `_encode_vae_image`: an image is a video of F = 1), in the VAE's dtype."""
    if video.ndim != 4 or video.shape[0] != 3:
        raise ValueError(f"video must be [3, F, H, W], got {tuple(video.shape)}")
    x = video.unsqueeze(0).to(_device(vae), vae.dtype)
    with torch.no_grad():
        z = vae.encode(x).latent_dist.mode()
    mean, std = vae_latent_stats(vae)
    view = (1, z.shape[1], 1, 1, 1)
    latents_mean = mean.view(view).to(z.device, z.dtype)
    latents_std = 1.0 / std.view(view).to(z.device, z.dtype)
    return ((z - latents_mean) * latents_std)[0]


def decode_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """The video [3, F, H, W] in [-1, 1] of normalized latents [C, F', H', W']: `z / (1 /
    latents_std) + latents_mean` as `WanPipeline.__call__` (and `QwenImagePipeline.__call__`, F' =
    1) computes it, then `vae.decode`."""
    if latents.ndim != 4:
        raise ValueError(f"latents must be [C, F, H, W], got {tuple(latents.shape)}")
    z = latents.unsqueeze(0).to(_device(vae), vae.dtype)
    mean, std = vae_latent_stats(vae)
    view = (1, z.shape[1], 1, 1, 1)
    latents_mean = mean.view(view).to(z.device, z.dtype)
    latents_std = 1.0 / std.view(view).to(z.device, z.dtype)
    z = z / latents_std + latents_mean
    with torch.no_grad():
        return vae.decode(z, return_dict=False)[0][0]


# ---- text encoder --------------------------------------------------------------------------------


def model_dirs(spec, model: str, inputs: str) -> tuple[Path, Path] | None:
    """(model directory, its tokenizer / processor directory) of `spec`: a diffusers pipeline
    directory's `model`/ and `inputs`/ (the model's own directory where `inputs`/ is missing), or a
    model directory itself; None if it is neither."""
    p = Path(spec)
    if (p / model / "config.json").is_file():
        aux = p / inputs
        return p / model, aux if aux.is_dir() else p / model
    if (p / "config.json").is_file():
        return p, p
    return None


def text_encoder_dirs(spec) -> tuple[Path, Path]:
    """(encoder directory, tokenizer directory) of directory spec `spec`; a UserError if none."""
    dirs = model_dirs(spec, "text_encoder", "tokenizer")
    if dirs is not None:
        return dirs
    raise UserError(
        f"text encoder not found: {spec} (need a UMT5EncoderModel or Qwen2_5_VLForConditionalGeneration directory with its "
        "tokenizer, a diffusers pipeline directory with text_encoder/ and tokenizer/, or 'tiny')"
    )


def is_qwen_text_config(config: dict) -> bool:
    """Whether a text encoder's config.json (as a dict) is a Qwen2.5-VL model's."""
    return QWEN_TEXT_CLASS in (config.get("architectures") or []) or config.get("model_type") == QWEN_TEXT_MODEL_TYPE


def _tiny_qwen_text_encoder(tokenizer):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else pad
    text = dict(TINY_QWEN_TEXT_CONFIG, rope_parameters=dict(TINY_QWEN_TEXT_CONFIG["rope_parameters"]))
    config = Qwen2_5_VLConfig(
        text_config=dict(text, vocab_size=len(tokenizer), pad_token_id=pad, bos_token_id=None, eos_token_id=eos),
        vision_config=dict(TINY_QWEN_VISION_CONFIG),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Qwen2_5_VLForConditionalGeneration(config)


def load_text_encoder(spec: str, dtype=torch.float32, family: str = "wan"):
    """(tokenizer, frozen text encoder in `dtype` on the CPU) of `spec` (see the module docstring):
    a UMT5EncoderModel, or a Qwen2_5_VLForConditionalGeneration for a directory whose config.json
    names it (`architectures` / `model_type`) or for "tiny" with family="qwen_image"."""
    from transformers import AutoTokenizer, UMT5Config, UMT5EncoderModel

    check_family(family)
    if str(spec) == TINY:
        from loongforge.core.data.text.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(TINY)
        if family == "qwen_image":
            encoder = _tiny_qwen_text_encoder(tokenizer)
            if dtype != encoder.dtype:
                encoder = encoder.to(dtype)
            return tokenizer, _frozen(encoder)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        config = UMT5Config(
            vocab_size=len(tokenizer),
            pad_token_id=pad,
            eos_token_id=tokenizer.eos_token_id if tokenizer.eos_token_id is not None else pad,
            decoder_start_token_id=pad,
            **TINY_TEXT_CONFIG,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            encoder = UMT5EncoderModel(config)
        if dtype != encoder.dtype:
            encoder = encoder.to(dtype)
        return tokenizer, _frozen(encoder)
    enc_dir, tok_dir = text_encoder_dirs(spec)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    except Exception as e:  # transformers raises many types for unreadable tokenizer files
        raise UserError(f"cannot load the tokenizer from {tok_dir}: {_first_line(e)}") from None
    if is_qwen_text_config(_read_config(enc_dir / "config.json")):
        from transformers import Qwen2_5_VLForConditionalGeneration as cls
    else:
        cls = UMT5EncoderModel
    try:
        encoder = cls.from_pretrained(str(enc_dir), **_transformers_dtype_kwarg(dtype))
    except Exception as e:
        raise UserError(f"cannot load the text encoder ({cls.__name__}) from {enc_dir}: {_first_line(e)}") from None
    return tokenizer, _frozen(encoder)


def _is_qwen_text_encoder(encoder) -> bool:
    return getattr(encoder.config, "model_type", None) == QWEN_TEXT_MODEL_TYPE


def check_text_encoder(encoder, family: str = "wan"):
    """`encoder` if it is the text encoder of `family` (Qwen-Image: a Qwen2.5-VL model; Wan:
    anything else, a UMT5 encoder), else a UserError naming both."""
    check_family(family)
    if _is_qwen_text_encoder(encoder) != (family == "qwen_image"):
        want = QWEN_TEXT_CLASS if family == "qwen_image" else "UMT5EncoderModel"
        raise UserError(f"the text encoder is a {type(encoder).__name__}; family {family!r} needs a {want}")
    return encoder


def text_dim(encoder) -> int:
    """The width of the text states `encode_text` returns: UMT5's d_model, Qwen2.5-VL's text
    hidden size."""
    if _is_qwen_text_encoder(encoder):
        return int(encoder.config.text_config.hidden_size)
    return int(encoder.config.d_model)


def clean_caption(caption: str) -> str:
    """The caption as WanPipeline cleans a prompt before tokenizing (diffusers' `prompt_clean`)."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    return prompt_clean(caption)


def encode_text(tokenizer, encoder, captions: list[str], max_length: int = DEFAULT_MAX_LENGTH, family: str = "wan") -> list[torch.Tensor]:
    """Each caption's text embeddings [L_i, D] in the encoder's dtype, L_i its number of real
    tokens (at most `max_length`): `WanPipeline._get_t5_prompt_embeds` before it pads; for
    family="qwen_image" `QwenImagePipeline._get_qwen_prompt_embeds` before it pads, cut to
    `max_length` as `encode_prompt(max_sequence_length=max_length)` does (see the module
    docstring; the captions are encoded as one batch, as the pipeline does)."""
    check_text_encoder(encoder, family)
    if family == "qwen_image":
        return _encode_text_qwen(tokenizer, encoder, captions, max_length)
    prompts = [clean_caption(c) for c in captions]
    inputs = tokenizer(
        prompts,
        padding="max_length",
        max_length=max_length,
        truncation=True,
        add_special_tokens=True,
        return_attention_mask=True,
        return_tensors="pt",
    )
    ids, mask = inputs.input_ids, inputs.attention_mask
    seq_lens = mask.gt(0).sum(dim=1).long()
    device = _device(encoder)
    with torch.no_grad():
        embeds = encoder(ids.to(device), mask.to(device)).last_hidden_state
    embeds = embeds.to(dtype=encoder.dtype)
    return [u[:v].clone() for u, v in zip(embeds, seq_lens)]


def _encode_text_qwen(tokenizer, encoder, captions: list[str], max_length: int) -> list[torch.Tensor]:
    if not 1 <= max_length <= QWEN_TOKENIZER_MAX_LENGTH:
        raise UserError(f"max_length={max_length}: Qwen-Image takes 1 to {QWEN_TOKENIZER_MAX_LENGTH} text tokens")
    texts = [QWEN_PROMPT_TEMPLATE.format(c) for c in captions]
    tokens = tokenizer(texts, max_length=QWEN_TOKENIZER_MAX_LENGTH + QWEN_PROMPT_DROP, padding=True, truncation=True, return_tensors="pt")
    device = _device(encoder)
    ids, mask = tokens.input_ids.to(device), tokens.attention_mask.to(device)
    with torch.no_grad():
        hidden = encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
    keep = mask.bool()
    rows = torch.split(hidden[keep], keep.sum(dim=1).tolist(), dim=0)
    return [u[QWEN_PROMPT_DROP:][:max_length].to(dtype=encoder.dtype).clone() for u in rows]


# ---- image encoder (Wan2.1 image-to-video) -------------------------------------------------------


def image_encoder_dirs(spec) -> tuple[Path, Path]:
    """(CLIPVisionModel directory, CLIPImageProcessor directory) of directory spec `spec`; a
    UserError if none."""
    dirs = model_dirs(spec, "image_encoder", "image_processor")
    if dirs is not None:
        return dirs
    raise UserError(
        f"image encoder not found: {spec} (need a CLIPVisionModel directory with its preprocessor_config.json, a diffusers "
        "Wan I2V pipeline directory with image_encoder/ and image_processor/, or 'tiny')"
    )


def load_image_encoder(spec: str, dtype=torch.float32):
    """(CLIPImageProcessor, frozen CLIPVisionModel in `dtype` on the CPU) of `spec` (see the
    module docstring)."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    if str(spec) == TINY:
        size = TINY_CLIP_CONFIG["image_size"]
        processor = CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            encoder = CLIPVisionModel(CLIPVisionConfig(**TINY_CLIP_CONFIG))
        if dtype != encoder.dtype:
            encoder = encoder.to(dtype)
        return processor, _frozen(encoder)
    enc_dir, proc_dir = image_encoder_dirs(spec)
    try:
        processor = CLIPImageProcessor.from_pretrained(str(proc_dir))
    except Exception as e:  # transformers raises many types for unreadable files
        raise UserError(f"cannot load the image processor from {proc_dir}: {_first_line(e)}") from None
    try:
        encoder = CLIPVisionModel.from_pretrained(str(enc_dir), **_transformers_dtype_kwarg(dtype))
    except Exception as e:
        raise UserError(f"cannot load the image encoder (CLIPVisionModel) from {enc_dir}: {_first_line(e)}") from None
    return processor, _frozen(encoder)


def image_dim(encoder) -> int:
    """The width of the features `encode_image` returns (Wan2.1 I2V's CLIP ViT-H/14: 1280)."""
    return int(encoder.config.hidden_size)


def frame_image(frame: torch.Tensor):
    """A float frame [3, H, W] in [-1, 1] (the VAE's input) as the PIL image it was read as."""
    from PIL import Image

    pixels = ((frame.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    return Image.fromarray(pixels)


def encode_image(processor, encoder, image) -> torch.Tensor:
    """The CLIP features [tokens, image_dim] of one image (a PIL image) in the encoder's dtype:
    `WanImageToVideoPipeline.encode_image` (the processor's pixels, the penultimate hidden
    states)."""
    pixels = processor(images=image, return_tensors="pt").to(_device(encoder))
    with torch.no_grad():
        states = encoder(**pixels, output_hidden_states=True).hidden_states[-2]
    return states[0].to(dtype=encoder.dtype).clone()


def condition_video(video: torch.Tensor) -> torch.Tensor:
    """The video the I2V condition latents encode: the first frame, then zeros (`video_condition`
    of `WanImageToVideoPipeline.prepare_latents`), [3, F, H, W]."""
    return torch.cat([video[:, :1], video.new_zeros(video.shape[0], video.shape[1] - 1, *video.shape[2:])], dim=1)


def first_frame_mask(latent_frames: int, height: int, width: int, temporal: int = 4, dtype=torch.float32) -> torch.Tensor:
    """The I2V mask [temporal, F', h, w]: `prepare_latents`' `mask_lat_size` (the first of the
    4(F' - 1) + 1 frames kept, repeated `temporal` times, viewed as [F', temporal] and
    transposed), i.e. ones on latent frame 0 and zeros after."""
    frames = (latent_frames - 1) * temporal + 1
    mask = torch.ones(1, frames, height, width, dtype=dtype)
    mask[:, 1:] = 0
    mask = torch.cat([mask[:, :1].repeat_interleave(temporal, dim=1), mask[:, 1:]], dim=1)
    return mask.view(latent_frames, temporal, height, width).transpose(0, 1).contiguous()


# ---- for a later process -------------------------------------------------------------------------


def save_frozen(vae_spec: str, text_spec: str, out_dir, family: str = "wan", image_spec: str | None = None) -> dict[str, str]:
    """What a later process (generation) loads: {"vae": spec, "text_encoder": spec}. A directory
    spec is recorded as its absolute path; a "tiny" one is written first, the VAE to
    `out_dir/vae` (`save_pretrained`), the text encoder and its tokenizer to `out_dir/text_encoder`
    and `out_dir/tokenizer`, and recorded as `out_dir/vae` and `out_dir` (a diffusers-pipeline-like
    directory that `load_vae` / `load_text_encoder` read). Each is written to a temporary sibling
    and renamed into place once complete. `family` picks the tiny models; the directories name
    their classes in their configs, so later loads need no family. `image_spec` (Wan2.1 I2V): the
    image encoder too, "image_encoder" (a tiny one written to `out_dir/image_encoder` and
    `out_dir/image_processor`, recorded as `out_dir`)."""
    from loongforge.core.outputs import replaced_dir

    check_family(family)
    out = Path(out_dir)
    result = {}
    if str(vae_spec) == TINY:
        out.mkdir(parents=True, exist_ok=True)
        with replaced_dir(out / "vae") as tmp:
            load_vae(TINY, family=family).save_pretrained(str(tmp))
        result["vae"] = str((out / "vae").resolve())
    else:
        vae_dir(vae_spec)
        result["vae"] = spec_key(vae_spec)
    if str(text_spec) == TINY:
        out.mkdir(parents=True, exist_ok=True)
        tokenizer, encoder = load_text_encoder(TINY, family=family)
        with replaced_dir(out / "text_encoder") as tmp:
            encoder.save_pretrained(str(tmp))
        with replaced_dir(out / "tokenizer") as tmp:
            tokenizer.save_pretrained(str(tmp))
        result["text_encoder"] = str(out.resolve())
    else:
        text_encoder_dirs(text_spec)
        result["text_encoder"] = spec_key(text_spec)
    if image_spec is not None and str(image_spec) == TINY:
        out.mkdir(parents=True, exist_ok=True)
        processor, encoder = load_image_encoder(TINY)
        with replaced_dir(out / "image_encoder") as tmp:
            encoder.save_pretrained(str(tmp))
        with replaced_dir(out / "image_processor") as tmp:
            processor.save_pretrained(str(tmp))
        result["image_encoder"] = str(out.resolve())
    elif image_spec is not None:
        image_encoder_dirs(image_spec)
        result["image_encoder"] = spec_key(image_spec)
    return result
