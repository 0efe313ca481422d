"""A `VisionRecord` -> one LLaVA-OneVision training sample (HF `LlavaOnevisionForConditionalGeneration`).

    enc = LlavaSampleEncoder(tokenizer, LlavaOnevisionConfig(...), max_length=4096, video_frames=8)
    sample = enc.encode(record)

What transformers' `LlavaOnevisionProcessor` gives for the rendered prompt and the record's images
and videos, as `processor.apply_chat_template(..., tokenize=True)` calls it (the images of one
conversation as one sample: `images=[[...]]`). The conversation goes through the chat template with
assistant-only labels (core's `SFTTokenizer`, as the Qwen encoder does; LLaVA-OneVision's published
template renders each message's images first, `<image>\\n` each, then its videos, `<video>\\n`
each, then its text, and marks only the assistant's text with `{% generation %}`, so `<|im_end|>`
is not trained on).

Images are processed by transformers' PIL `LlavaOnevisionImageProcessorPil` set from the model
config (tiles of `vision_config.image_size`, `image_grid_pinpoints`; mean and std 0.5, resample
bicubic: the llava-hf preprocessor_config.json): a sample of one image gets the anyres tiles (the
whole image resized to a tile, then the grid cut from the image resized and padded to its best
pinpoint); in a sample of several images each image is padded to a square (the mean colour) and
is one tile. Each `<image>` then becomes `image_token_count(cfg, height, width, multi_image=images
> 1)` copies of itself (core's count from the original size: the features `LlavaOnevisionVision`
gives the image, unpadded and shrunk to `anyres_max_N`, with a newline per row; 729 + 1 for one
of several images at LLaVA-OneVision's 27 x 27 patches).

Videos are decoded with core's PyAV reader (`uniform_frames`: frames in presentation order, only
the kept ones converted) and a fixed number of frames, `video_frames`, is sampled uniformly: frame
indices `arange(video_frames) * total // video_frames`, transformers' `default_sample_indices_fn` (what
`LlavaOnevisionVideoProcessor` samples with `do_sample_frames=True, num_frames=video_frames`; a
video of fewer frames repeats frames, where transformers refuses it). The fixed count gives every
video the same shape, so a pack's videos stack into one `[videos, frames, 3, S, S]`. Each frame is
processed as `LlavaOnevisionVideoProcessor` does: resized to a tile (S x S, the aspect ratio not
kept) with the image processing's resample, then rescaled and normalized in one step, (x - mean /
rescale_factor) / (std / rescale_factor) in float32 (its fused `rescale_and_normalize`). The
normalization is the image processing's: the published llava-hf checkpoints' video processor
config (`video_processor/preprocessor_config.json`, converted from SigLIP's) holds the same mean
and std 0.5, bicubic and 384 x 384 as their image processor (`LlavaOnevisionVideoProcessor`'s
class defaults, CLIP's mean / std, are not what they use). transformers resizes with torchvision
(bicubic, antialiased, on uint8) where this uses PIL's bicubic (the PIL image processors' resize):
the two may differ slightly in a pixel's value (not compared: torchvision is not installed). Each
`<video>` becomes `video_token_count(cfg, video_frames)` copies of itself (frames * ceil(side /
2)^2 + 1: each frame's patch map pooled to half its side, one newline after the video), as the
processor's `replace_video_token` counts them.

Positions are 1-D (0 ... T-1 on each of 3 rows: the model's pack format).

`encode` returns (T tokens):
    input_ids            LongTensor [T]
    labels               LongTensor [T], -100 except on assistant tokens
    position_ids         LongTensor [3, T] (0 ... T-1 on each row)
    mm_token_type_ids    LongTensor [T]: 0 text, 1 image pad, 2 video pad (HF's token types)
    pixel_values         FloatTensor [tiles of all images, 3, S, S] (images back to back), or None
    image_sizes          LongTensor [images, 2]: each image's original (height, width), or None
    batch_num_images     LongTensor [1]: the sample's image count, or None without images (HF's
                         processor leaves image-less samples out of it)
    pixel_values_videos  FloatTensor [videos, video_frames, 3, S, S], or None
    image_grid_thw, video_grid_thw, second_per_grid_ts: None (Qwen2-VL's keys)

Bad samples raise BadSample with the Qwen encoder's reasons: "over_long", "missing_media" /
"corrupt_media" (an image or video file gone or not decodable), "bad_media_size" (an image the
processor refuses), "placeholder_mismatch" (the template rendered another number of `<image>`
than the record has images, or of `<video>` than it has videos), core's "template_error".
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from loongforge.core.data.media import BadMedia, uniform_frames
from loongforge.core.data.text import IGNORE, BadSample, SFTTokenizer
from loongforge.core.errors import UserError
from loongforge.core.foundation.llava_onevision import LlavaOnevisionConfig, image_token_count, num_image_tiles, video_token_count
from loongforge.core.foundation.mrope import IMAGE, TEXT, VIDEO
from loongforge.vlm.data.encode import ChatVisionEncoder, open_source_image, special_token_id
from loongforge.vlm.data.formats import VisionRecord

LLAVA_IMAGE_TOKEN, LLAVA_VIDEO_TOKEN = "<image>", "<video>"
# llava-hf LLaVA-OneVision preprocessor_config.json: SigLIP's normalization, bicubic resizing
LLAVA_OV_IMAGE_PROCESSING = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 3}
# frames sampled from each video (data.image.video_frames): transformers' examples use 8; LLaVA-OneVision's
# own video training sampled up to 32 (196 tokens a frame at 384 px)
LLAVA_OV_VIDEO_FRAMES = 8
# preprocessor_config.json fields taken as they are (size and image_grid_pinpoints must be the model's)
_PREPROCESSOR_KEYS = ("image_mean", "image_std", "resample", "rescale_factor")


def llava_image_processor(cfg: LlavaOnevisionConfig, **options):
    """transformers' PIL `LlavaOnevisionImageProcessorPil` for `cfg`: tiles of the tower's
    image_size, the config's image_grid_pinpoints, LLaVA-OneVision's normalization; `options`
    (image_mean, image_std, resample, rescale_factor) override it."""
    import transformers

    size = cfg.vision_config.image_size
    kw = {**LLAVA_OV_IMAGE_PROCESSING, **options}
    return transformers.LlavaOnevisionImageProcessorPil(
        size={"height": size, "width": size}, image_grid_pinpoints=[list(p) for p in cfg.image_grid_pinpoints], **kw
    )


class LlavaSampleEncoder(ChatVisionEncoder):
    """VisionRecord -> LLaVA-OneVision sample dict (module docstring). `cfg`: the model's
    `LlavaOnevisionConfig` (tile size, pinpoints, feature select strategy, anyres_max_N decide the
    pixels and the pad counts); `image_processing`: LlavaOnevisionImageProcessorPil options over
    LLaVA-OneVision's (image_mean, image_std, resample, rescale_factor), which video frames are
    processed with too; `video_frames`: the frames sampled uniformly from each video. `template`
    and the other keyword options are core's SFTTokenizer's (default: the tokenizer's chat
    template, loss on the assistant turns only)."""

    def __init__(
        self,
        tokenizer,
        cfg: LlavaOnevisionConfig,
        max_length: int = 4096,
        template: str | None = None,
        image_token: str = LLAVA_IMAGE_TOKEN,
        video_token: str = LLAVA_VIDEO_TOKEN,
        image_processing: dict | None = None,
        video_frames: int = LLAVA_OV_VIDEO_FRAMES,
        **sft_options,
    ):
        if not isinstance(cfg, LlavaOnevisionConfig):
            raise UserError(f"LlavaSampleEncoder takes a LlavaOnevisionConfig, got {type(cfg).__name__}")
        unknown = set(image_processing or {}) - set(_PREPROCESSOR_KEYS)
        if unknown:
            raise UserError(f"LLaVA image processing: unknown keys {sorted(unknown)} (choose from {', '.join(_PREPROCESSOR_KEYS)})")
        if isinstance(video_frames, bool) or not isinstance(video_frames, int) or video_frames < 1:
            raise UserError(f"LLaVA-OneVision video_frames (data.image.video_frames) must be a positive int, got {video_frames!r}")
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.sft = SFTTokenizer(tokenizer, template, max_length=max_length, **sft_options)
        self.image_token_id = special_token_id(tokenizer, image_token)
        self.video_token_id = special_token_id(tokenizer, video_token)
        self.image_processor = llava_image_processor(cfg, **(image_processing or {}))
        self.frame_processing = {**LLAVA_OV_IMAGE_PROCESSING, "rescale_factor": 1 / 255, **(image_processing or {})}
        self.video_frames = video_frames

    @classmethod
    def from_hf(cls, tokenizer, path, max_length: int = 4096, **options) -> LlavaSampleEncoder:
        """The encoder of an HF LLaVA-OneVision directory: config.json's model config,
        preprocessor_config.json's normalization (its size and image_grid_pinpoints must be the
        config's: the pad counts are computed from the config, as the model computes its features)."""
        path = Path(path)

        def read(name: str) -> dict:
            f = path / name
            if not f.is_file():
                raise UserError(f"{path}: no {name} (an HF LLaVA-OneVision directory has one)")
            try:
                return json.loads(f.read_text())
            except json.JSONDecodeError as e:
                raise UserError(f"{f}: not JSON: {e}") from None

        cfg = LlavaOnevisionConfig.from_hf(read("config.json"))
        pre = read("preprocessor_config.json")
        side = cfg.vision_config.image_size
        size = pre.get("size") or {}
        sides = {size.get("height", side), size.get("width", side), size.get("shortest_edge", side)}
        if sides != {side}:
            raise UserError(f"{path}: preprocessor_config.json size {size} is not the tower's image_size {side}")
        pins = pre.get("image_grid_pinpoints")
        if pins is not None and [list(p) for p in pins] != cfg.image_grid_pinpoints:
            raise UserError(f"{path}: preprocessor_config.json image_grid_pinpoints differ from config.json's")
        processing = {k: pre[k] for k in _PREPROCESSOR_KEYS if pre.get(k) is not None}
        processing.update(options.pop("image_processing", None) or {})
        return cls(tokenizer, cfg, max_length, image_processing=processing, **options)

    def _expanded(self, record: VisionRecord, ids: list, labels: list) -> dict:
        """Each `<image>` (`<video>`) expanded to its image's (video's) feature count, the pixels,
        the positions."""
        pads, video_pads = ids.count(self.image_token_id), ids.count(self.video_token_id)
        if pads != len(record.images) or video_pads != len(record.videos):
            raise BadSample(
                "placeholder_mismatch",
                f"the chat template rendered {pads} image and {video_pads} video pads for {len(record.images)} images "
                f"and {len(record.videos)} videos",
            )
        if record.videos and self.cfg.vision_feature_select_strategy == "default":
            raise UserError(
                "LLaVA-OneVision: vision_feature_select_strategy 'default' drops a patch of each frame, which can't then be "
                "pooled: videos need 'full' (HF fails the same way)"
            )
        images = self._images(record.images)
        videos = self._videos(record.videos)
        multi = len(record.images) > 1
        try:
            counts = iter([] if images is None else [image_token_count(self.cfg, h, w, multi) for h, w in images["image_sizes"].tolist()])
        except ValueError as e:  # 'default' select strategy with an anyres image (HF fails the same way)
            raise UserError(f"LLaVA-OneVision: {e}") from None
        per_video = video_token_count(self.cfg, self.video_frames)
        out_ids, out_labels, types = [], [], []
        for t, label in zip(ids, labels):
            if t == self.image_token_id:
                n = next(counts)
                out_ids += [t] * n
                out_labels += [IGNORE] * n
                types += [IMAGE] * n
            elif t == self.video_token_id:
                out_ids += [t] * per_video
                out_labels += [IGNORE] * per_video
                types += [VIDEO] * per_video
            else:
                out_ids.append(t)
                out_labels.append(label)
                types.append(TEXT)
        if len(out_ids) > self.max_length:
            raise BadSample("over_long", f"{len(out_ids)} > {self.max_length} tokens with the image and video pads expanded")
        sample = {
            "input_ids": torch.tensor(out_ids, dtype=torch.long),
            "labels": torch.tensor(out_labels, dtype=torch.long),
            "position_ids": torch.arange(len(out_ids), dtype=torch.long).repeat(3, 1),
            "mm_token_type_ids": torch.tensor(types, dtype=torch.long),
            "pixel_values": None,
            "image_sizes": None,
            "batch_num_images": None,
            "image_grid_thw": None,
            "pixel_values_videos": None,
            "video_grid_thw": None,
            "second_per_grid_ts": None,
        }
        sample.update(images or {})
        sample.update(videos or {})
        return sample

    def _images(self, sources) -> dict | None:
        """pixel_values (every image's tiles back to back), image_sizes, batch_num_images."""
        if not sources:
            return None
        pil = [open_source_image(s) for s in sources]
        try:  # one sample's images, as HF's apply_chat_template batches them; unpadded tile counts
            out = self.image_processor(images=[pil], do_pad=False)
        except ValueError as e:
            raise BadSample("bad_media_size", str(e).splitlines()[0]) from None
        sizes = [[int(v) for v in s] for s in out["image_sizes"]]
        tiles = [np.asarray(p) for p in out["pixel_values"]]
        multi = len(pil) > 1
        want = [num_image_tiles(self.cfg, h, w, multi) for h, w in sizes]
        if [len(t) for t in tiles] != want:  # the processor and core's count disagree: transformers changed
            raise RuntimeError(f"LlavaOnevisionImageProcessorPil made {[len(t) for t in tiles]} tiles, expected {want}")
        return {
            "pixel_values": torch.from_numpy(np.concatenate(tiles)).to(torch.float32),
            "image_sizes": torch.tensor(sizes, dtype=torch.long),
            "batch_num_images": torch.tensor([len(pil)], dtype=torch.long),
        }

    def _videos(self, sources) -> dict | None:
        """pixel_values_videos [videos, video_frames, 3, S, S]."""
        if not sources:
            return None
        return {"pixel_values_videos": torch.stack([self._video(s) for s in sources])}

    def _video(self, source) -> torch.Tensor:
        """One video's `video_frames` frames sampled uniformly, processed (module docstring)."""
        try:
            frames = uniform_frames(source, self.video_frames)
        except BadMedia as e:
            raise BadSample(f"{e.reason}_media", e.message) from None
        return self.frame_pixels(frames)

    def frame_pixels(self, frames: np.ndarray) -> torch.Tensor:
        """uint8 frames [F, H, W, 3] -> [F, 3, S, S] as `LlavaOnevisionVideoProcessor` processes them:
        each resized to S x S, then (x - mean / rescale_factor) / (std / rescale_factor) in float32."""
        from PIL import Image

        p, side = self.frame_processing, self.cfg.vision_config.image_size
        resized = np.stack([np.asarray(Image.fromarray(f).resize((side, side), resample=p["resample"])) for f in frames])
        x = torch.from_numpy(resized).permute(0, 3, 1, 2).to(torch.float32)
        mean = torch.tensor(p["image_mean"], dtype=torch.float32) * (1.0 / p["rescale_factor"])
        std = torch.tensor(p["image_std"], dtype=torch.float32) * (1.0 / p["rescale_factor"])
        return x.sub_(mean[:, None, None]).div_(std[:, None, None]).contiguous()


__all__ = [
    "LLAVA_IMAGE_TOKEN",
    "LLAVA_OV_IMAGE_PROCESSING",
    "LLAVA_OV_VIDEO_FRAMES",
    "LLAVA_VIDEO_TOKEN",
    "LlavaSampleEncoder",
    "llava_image_processor",
]
