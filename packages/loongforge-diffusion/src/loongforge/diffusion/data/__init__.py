"""Text-to-video (Wan) and text-to-image (Qwen-Image) data: media read without torchvision, buckets, the
frozen encoders, latent preprocessing and the dataset of its output.

`read_video` / `read_image` decode with PyAV / PIL to uint8 frames (errors: `BadMedia` with a
reason, "missing", "corrupt" or "too_short"); `resize_crop` scales to cover and centre-crops to
float32 [3, F, H, W] in [-1, 1].

`Bucket`, `parse_buckets` ("HxWxF" strings: frames 4k+1, sides divisible by 16) and
`choose_bucket` (closest aspect ratio among the buckets short enough).

`load_vae` (diffusers' `AutoencoderKLWan`, or `AutoencoderKLQwenImage`) and `load_text_encoder` (a
UMT5 encoder, or a Qwen2.5-VL model, and its tokenizer), from a directory or "tiny" (random, seed 0;
`family="qwen_image"` for Qwen-Image's); `encode_video` / `decode_latents` with the pipelines'
per-channel latent normalization; `encode_text` as `WanPipeline._get_t5_prompt_embeds` (or
`QwenImagePipeline._get_qwen_prompt_embeds`) before padding; `load_image_encoder` / `encode_image`
(Wan2.1 image-to-video's CLIP features), `condition_video` and `first_frame_mask` (its condition
channels, as `WanImageToVideoPipeline.prepare_latents` builds them); `save_frozen` writes tiny encoders
where a later process can load them.

`preprocess` encodes a captioned folder (captions.jsonl or metadata.csv) into safetensors shards,
resumably; `LatentDataset` reads them. `write_demo_videos` writes a small captioned demo set of
coloured shapes moving.
"""

from loongforge.diffusion.data.buckets import Bucket, check_bucket, choose_bucket, parse_buckets
from loongforge.diffusion.data.demo_media import demo_entries, shape_centre, write_demo_videos
from loongforge.diffusion.data.encoders import (
    DEFAULT_MAX_LENGTH,
    FAMILIES,
    TINY_CLIP_CONFIG,
    TINY_QWEN_TEXT_CONFIG,
    TINY_QWEN_VAE_CONFIG,
    TINY_TEXT_CONFIG,
    TINY_VAE_CONFIG,
    check_family,
    check_text_encoder,
    clean_caption,
    condition_video,
    decode_latents,
    encode_image,
    encode_text,
    encode_video,
    first_frame_mask,
    frame_image,
    image_dim,
    load_image_encoder,
    load_text_encoder,
    load_vae,
    save_frozen,
    text_dim,
    vae_latent_stats,
)
from loongforge.diffusion.data.media import BadMedia, decode_frames, read_image, read_video, resize_crop
from loongforge.diffusion.data.preprocess import FORMAT, LatentDataset, preprocess, read_meta, read_source

__all__ = [
    "BadMedia",
    "Bucket",
    "DEFAULT_MAX_LENGTH",
    "FAMILIES",
    "FORMAT",
    "LatentDataset",
    "TINY_CLIP_CONFIG",
    "TINY_QWEN_TEXT_CONFIG",
    "TINY_QWEN_VAE_CONFIG",
    "TINY_TEXT_CONFIG",
    "TINY_VAE_CONFIG",
    "check_bucket",
    "check_family",
    "check_text_encoder",
    "choose_bucket",
    "clean_caption",
    "condition_video",
    "decode_frames",
    "decode_latents",
    "demo_entries",
    "encode_image",
    "encode_text",
    "encode_video",
    "first_frame_mask",
    "frame_image",
    "image_dim",
    "load_image_encoder",
    "load_text_encoder",
    "load_vae",
    "parse_buckets",
    "preprocess",
    "read_image",
    "read_meta",
    "read_source",
    "read_video",
    "resize_crop",
    "save_frozen",
    "shape_centre",
    "text_dim",
    "vae_latent_stats",
    "write_demo_videos",
]
