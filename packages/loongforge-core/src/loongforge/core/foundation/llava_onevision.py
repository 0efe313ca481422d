"""LLaVA-OneVision's vision side as a plain torch module, with its HF mapping table.

The math of HF `LlavaOnevisionModel.get_image_features` (and `get_video_features`): every tile of
an image (the processor's base tile, the whole image resized, then the anyres grid of tiles cut
from the image resized and padded to the best of `image_grid_pinpoints`) goes through the SigLIP
tower (`siglip.SiglipVisionTower`, reused); the hidden state HF selects with
`vision_feature_layer` (an index into HF's `hidden_states`: 0 is the embeddings, k the output of
layer k, -1 the last layer's output; never SigLIP's `post_layernorm`) goes through the projector
(linear, GELU, linear) to the language model's width; then `pack_image_features`: the grid tiles
laid out as one feature map, the padding rows / columns the processor added cut off again
(`unpad_image`), the map shrunk bilinearly when it holds more than `anyres_max_N` tiles' worth of
patches, `image_newline` after every row, the base tile's features first. The result is what
HF puts in place of an image's `<image>` tokens; `image_token_count` is how many there are (the
processor's count, from the image's original size alone).

HF names (`LLAVA_ONEVISION_VISION_TABLE`) are those of `LlavaOnevisionModel`'s state dict, which
are also the names transformers 5 writes to files; `llava_onevision_vision_table` gives the
in-memory names of `LlavaOnevisionForConditionalGeneration` (`model.` before each) and those of
files written by transformers 4 (`vision_tower.vision_model.` before the tower's).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from loongforge.core.errors import UserError
from loongforge.core.foundation.hf_mapping import Row, prefixed
from loongforge.core.foundation.siglip import SIGLIP_VISION_TABLE, SiglipVisionConfig, SiglipVisionTower
from loongforge.core.ops import OpTable
from torch import nn

# HF `SiglipVisionConfig`'s own defaults (a vision_config dict saved by transformers holds only the
# fields that differ from them) and the vision_config `LlavaOnevisionConfig` builds when it has none.
_SIGLIP_DEFAULTS = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "image_size": 224,
    "patch_size": 16,
    "vision_use_head": True,
}
_LLAVA_OV_VISION_DEFAULTS = {
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_hidden_layers": 26,
    "num_attention_heads": 16,
    "image_size": 384,
    "patch_size": 14,
    "vision_use_head": False,
}
_ASPECT = re.compile(r"anyres_max_([1-9][0-9]*)")


@dataclass
class LlavaOnevisionConfig:
    """The vision side's shape under HF `LlavaOnevisionConfig`'s names; `text_hidden_size` is
    HF's `text_config.hidden_size` (the projector's width). `image_grid_pinpoints=None` gives
    HF's default grid: every (a x b) tiles, a and b from 1 to 6."""

    vision_config: SiglipVisionConfig = field(default_factory=SiglipVisionConfig)
    text_hidden_size: int = 32
    image_grid_pinpoints: list | None = None
    vision_feature_layer: int | list[int] = -1
    vision_feature_select_strategy: str = "full"
    vision_aspect_ratio: str = "anyres_max_9"
    projector_hidden_act: str = "gelu"
    multimodal_projector_bias: bool = True

    def __post_init__(self):
        size = self.vision_config.image_size
        if self.image_grid_pinpoints is None:
            self.image_grid_pinpoints = [[a * size, b * size] for a in range(1, 7) for b in range(1, 7)]
        self.image_grid_pinpoints = [list(p) for p in self.image_grid_pinpoints]
        if isinstance(self.vision_feature_layer, (list, tuple)):
            self.vision_feature_layer = list(self.vision_feature_layer)
        self._check()

    def _check(self):
        def bad(key: str, why: str):
            raise UserError(f"LLaVA-OneVision config: {key}={getattr(self, key)!r} is not supported ({why})")

        if self.projector_hidden_act != "gelu":
            bad("projector_hidden_act", "only gelu")
        if self.vision_feature_select_strategy not in ("full", "default"):
            bad("vision_feature_select_strategy", "only full or default")
        if not isinstance(self.vision_aspect_ratio, str) or not _ASPECT.fullmatch(self.vision_aspect_ratio):
            bad("vision_aspect_ratio", "only anyres_max_N, N >= 1")
        n = self.vision_config.num_layers
        layers = self.vision_feature_layer if isinstance(self.vision_feature_layer, list) else [self.vision_feature_layer]
        if not layers or any(isinstance(k, bool) or not isinstance(k, int) or not -(n + 1) <= k <= n for k in layers):
            bad("vision_feature_layer", f"an index of SigLIP's {n + 1} hidden states, or a list of them")
        size = self.vision_config.image_size
        for p in self.image_grid_pinpoints:
            if len(p) != 2 or any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 or v % size for v in p):
                bad("image_grid_pinpoints", f"each a [height, width] of positive multiples of image_size {size}; {p} is not")
        if not isinstance(self.multimodal_projector_bias, bool):
            bad("multimodal_projector_bias", "a bool")

    @property
    def out_hidden_size(self) -> int:
        """The features' width (the language model's), as the Qwen towers name it."""
        return self.text_hidden_size

    @property
    def tile_side(self) -> int:
        """Patches along a tile's side (HF's `image_size // patch_size`)."""
        return self.vision_config.image_size // self.vision_config.patch_size

    @property
    def feature_layers(self) -> list[int]:
        """`vision_feature_layer` as a list of non-negative indices into HF's hidden_states."""
        layers = self.vision_feature_layer if isinstance(self.vision_feature_layer, list) else [self.vision_feature_layer]
        return [k % (self.vision_config.num_layers + 1) for k in layers]

    @property
    def max_num_patches(self) -> int:
        """N of `anyres_max_N`: the most tiles' worth of patches an image's grid keeps."""
        return int(_ASPECT.fullmatch(self.vision_aspect_ratio).group(1))

    def repeats(self) -> dict[str, int]:
        return self.vision_config.repeats()

    def hf_config(self) -> dict:
        """The HF `LlavaOnevisionConfig` fields of the vision side (`text_config` holds only
        `hidden_size`: the language model is another component's)."""
        vision = {**self.vision_config.hf_config(), "model_type": "siglip_vision_model", "vision_use_head": False}
        return {
            "vision_config": vision,
            "text_config": {"hidden_size": self.text_hidden_size},
            "image_grid_pinpoints": [list(p) for p in self.image_grid_pinpoints],
            "vision_feature_layer": list(self.vision_feature_layer)
            if isinstance(self.vision_feature_layer, list)
            else self.vision_feature_layer,
            "vision_feature_select_strategy": self.vision_feature_select_strategy,
            "vision_aspect_ratio": self.vision_aspect_ratio,
            "projector_hidden_act": self.projector_hidden_act,
            "multimodal_projector_bias": self.multimodal_projector_bias,
        }

    @classmethod
    def from_hf(cls, d: dict) -> "LlavaOnevisionConfig":
        """From HF `LlavaOnevisionConfig.to_dict()` or a config.json (fields left out take HF's defaults)."""
        vision = d.get("vision_config")
        vision = {**_LLAVA_OV_VISION_DEFAULTS} if vision is None else {**_SIGLIP_DEFAULTS, **vision}
        if vision.get("model_type", "siglip_vision_model") != "siglip_vision_model":
            raise UserError(
                f"LLaVA-OneVision config: vision_config.model_type={vision['model_type']!r} is not supported (only siglip_vision_model)"
            )
        if vision["vision_use_head"]:
            raise UserError(
                "LLaVA-OneVision config: vision_config.vision_use_head=True is not supported (LLaVA-OneVision uses no pooling head)"
            )
        text = d.get("text_config") or {}
        if "hidden_size" in text:
            text_hidden = text["hidden_size"]
        elif text.get("model_type", "qwen2") == "qwen2":
            text_hidden = 4096  # HF Qwen2Config's default, which a saved config leaves out
        else:
            raise UserError(f"LLaVA-OneVision config: text_config.hidden_size is missing (text_config.model_type={text['model_type']!r})")
        defaults = cls.__dataclass_fields__
        return cls(
            vision_config=SiglipVisionConfig.from_hf(vision),
            text_hidden_size=text_hidden,
            image_grid_pinpoints=d.get("image_grid_pinpoints"),
            **{k: d[k] if d.get(k) is not None else defaults[k].default for k in _HF_FIELDS},
        )


_HF_FIELDS = (
    "vision_feature_layer",
    "vision_feature_select_strategy",
    "vision_aspect_ratio",
    "projector_hidden_act",
    "multimodal_projector_bias",
)


def llava_onevision_vision_table(hf_prefix: str = "", tower_prefix: str = "vision_tower.") -> tuple[Row, ...]:
    """The table with HF names `hf_prefix + tower_prefix + <SigLIP name>`, `hf_prefix +
    multi_modal_projector.*`, `hf_prefix + image_newline`. `hf_prefix="model."`: the state dict
    of HF `LlavaOnevisionForConditionalGeneration` in memory; `tower_prefix="vision_tower.vision_model."`:
    checkpoints written by transformers 4 (the llava-hf hub files; transformers 5 loads both)."""
    rows = prefixed(SIGLIP_VISION_TABLE, "tower.", hf_prefix + tower_prefix)
    proj = hf_prefix + "multi_modal_projector."
    return rows + (
        Row("projector_fc1.weight", (proj + "linear_1.weight",)),
        Row("projector_fc1.bias", (proj + "linear_1.bias",), optional=True),
        Row("projector_fc2.weight", (proj + "linear_2.weight",)),
        Row("projector_fc2.bias", (proj + "linear_2.bias",), optional=True),
        Row("image_newline", (hf_prefix + "image_newline",)),
    )


LLAVA_ONEVISION_VISION_TABLE = llava_onevision_vision_table()


def select_best_resolution(original_size: tuple[int, int], pinpoints) -> tuple[int, int]:
    """HF's choice of (height, width) among `pinpoints` for an image of `original_size` (height,
    width): the most of the image's pixels kept after fitting it in, then the least padding."""
    height, width = original_size
    best, most, least = None, 0, float("inf")
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = w * h - effective
        if effective > most or (effective == most and wasted < least):
            best, most, least = (h, w), effective, wasted
    return best


def _unpadded(orig_h: int, orig_w: int, cur_h: int, cur_w: int) -> tuple[int, int]:
    """(rows, columns) cut off each side of a cur_h x cur_w feature map that holds an image of
    orig_h x orig_w resized to fit and padded evenly (HF's `unpad_image`)."""
    if orig_w / orig_h > cur_w / cur_h:
        return (cur_h - int(round(orig_h * (cur_w / orig_w), 7))) // 2, 0
    return 0, (cur_w - int(round(orig_w * (cur_h / orig_h), 7))) // 2


def _downsampled(cfg: LlavaOnevisionConfig, h: int, w: int) -> tuple[int, int] | None:
    """The (rows, columns) HF shrinks an h x w grid map to, None if it keeps it."""
    ratio = math.sqrt(h * w / (cfg.max_num_patches * cfg.tile_side**2))
    return (int(h // ratio), int(w // ratio)) if ratio > 1.1 else None


def _default_strategy_refused():
    return ValueError(
        "vision_feature_select_strategy 'default' drops each tile's first patch (SigLIP has no CLS token), "
        "so an image's anyres grid can't be laid out (HF fails the same way); use 'full', or multi-image samples"
    )


def image_grid_shape(cfg: LlavaOnevisionConfig, height: int, width: int) -> tuple[int, int]:
    """(rows, columns) of tiles of the anyres grid of an image of `height` x `width` pixels."""
    h, w = select_best_resolution((height, width), cfg.image_grid_pinpoints)
    return h // cfg.vision_config.image_size, w // cfg.vision_config.image_size


def num_image_tiles(cfg: LlavaOnevisionConfig, height: int, width: int, multi_image: bool = False) -> int:
    """How many tiles the processor makes of an image: the base tile and its grid (one tile only
    for the images of a sample of several, which the processor pads to a square)."""
    if multi_image:
        return 1
    rows, cols = image_grid_shape(cfg, height, width)
    return 1 + rows * cols


def image_token_count(cfg: LlavaOnevisionConfig, height: int, width: int, multi_image: bool = False) -> int:
    """How many `<image>` tokens `LlavaOnevisionProcessor` expands one image of `height` x `width`
    pixels (original size) to: the rows of `LlavaOnevisionVision`'s features of that image.
    `multi_image`: the image is one of several in its sample (base tile and one newline only)."""
    side = cfg.tile_side
    count = side * side + 1
    if not multi_image:
        if cfg.vision_feature_select_strategy == "default":
            raise _default_strategy_refused()
        rows, cols = image_grid_shape(cfg, height, width)
        h, w = rows * side, cols * side
        cut_h, cut_w = _unpadded(height, width, h, w)
        h, w = h - 2 * cut_h, w - 2 * cut_w
        h, w = _downsampled(cfg, h, w) or (h, w)
        count = side * side + h * w + h
    return count - (cfg.vision_feature_select_strategy == "default")


def video_token_count(cfg: LlavaOnevisionConfig, frames: int) -> int:
    """How many `<video>` tokens the processor expands a video of `frames` frames to."""
    return frames * math.ceil(cfg.tile_side / 2) ** 2 + 1


class LlavaOnevisionVision(nn.Module):
    """`vision(pixel_values, image_sizes)`: the processor's tiles [images, tiles, channels, size,
    size] (padded to the most tiles of any image; or all images' tiles [tiles, channels, size,
    size] back to back) and each image's original (height, width) -> features [image tokens of
    all images, text_hidden_size], image after image: HF's image features after
    `pack_image_features`, concatenated. `batch_num_images` (the processor's): images in each
    sample; a sample of several images has one tile per image.

    The tower's `final_norm` (SigLIP's post_layernorm) is loaded and saved but unused, as are the
    layers after the deepest of `vision_feature_layer`: they get no gradient."""

    def __init__(self, cfg: LlavaOnevisionConfig, ops: OpTable | None = None):
        super().__init__()
        self.cfg = cfg
        self.tower = SiglipVisionTower(cfg.vision_config, ops)
        width = cfg.vision_config.hidden_size * len(cfg.feature_layers)
        bias = cfg.multimodal_projector_bias
        self.projector_fc1 = nn.Linear(width, cfg.text_hidden_size, bias=bias)
        self.projector_fc2 = nn.Linear(cfg.text_hidden_size, cfg.text_hidden_size, bias=bias)
        self.image_newline = nn.Parameter(torch.randn(cfg.text_hidden_size) / math.sqrt(cfg.text_hidden_size))
        # kept for the round trip, never used: out of training (they would get no gradient)
        self.tower.final_norm.requires_grad_(False)
        for layer in self.tower.layers[max(cfg.feature_layers) :]:
            layer.requires_grad_(False)

    def blocks(self) -> list[nn.Module]:
        """The tower's encoder layers: the unit of FSDP sharding and activation recompute."""
        return self.tower.blocks()

    def tile_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """Tiles [n, channels, size, size] -> projected patch features [n, patches, text_hidden_size]
        (HF: hidden_states[vision_feature_layer], the select strategy, multi_modal_projector)."""
        vc, tower = self.cfg.vision_config, self.tower
        if pixels.dim() != 4 or tuple(pixels.shape[1:]) != (vc.num_channels, vc.image_size, vc.image_size):
            raise ValueError(
                f"LLaVA-OneVision tiles are [n, {vc.num_channels}, {vc.image_size}, {vc.image_size}], got {tuple(pixels.shape)}"
            )
        wanted = self.cfg.feature_layers
        x = tower.embed(pixels)
        states = {0: x}
        for i, layer in enumerate(tower.layers[: max(wanted)]):
            x = layer(x)
            states[i + 1] = x
        x = torch.cat([states[k] for k in wanted], dim=-1)
        if self.cfg.vision_feature_select_strategy == "default":
            x = x[:, 1:]
        return self.projector_fc2(self.tower.ops.gelu(self.projector_fc1(x.to(self.projector_fc1.weight.dtype))))

    def forward(self, pixel_values: torch.Tensor, image_sizes, batch_num_images=None) -> torch.Tensor:
        sizes, multi = self.image_layout(image_sizes, batch_num_images)
        return self.image_features(self.image_tiles(pixel_values, sizes, multi), sizes, multi)

    def image_layout(self, image_sizes, batch_num_images=None) -> tuple[list[tuple[int, int]], list[bool]]:
        """(each image's original (height, width), whether it is one of several in its sample)."""
        sizes = [tuple(int(v) for v in s) for s in (image_sizes.tolist() if torch.is_tensor(image_sizes) else image_sizes)]
        if batch_num_images is None:
            return sizes, [False] * len(sizes)
        counts = batch_num_images.tolist() if torch.is_tensor(batch_num_images) else list(batch_num_images)
        multi = [n != 1 for n in counts for _ in range(n)]
        if len(multi) != len(sizes):
            raise ValueError(f"batch_num_images {counts} count {len(multi)} images, image_sizes holds {len(sizes)}")
        return sizes, multi

    def image_tiles(self, pixel_values: torch.Tensor, sizes, multi) -> torch.Tensor:
        """The processor's pixel_values ([images, tiles, ...] padded, or every image's tiles back to
        back) -> the tiles of every image back to back [tiles, channels, size, size]."""
        tiles = [num_image_tiles(self.cfg, h, w, m) for (h, w), m in zip(sizes, multi)]
        if pixel_values.dim() == 5:
            if pixel_values.shape[0] != len(sizes) or pixel_values.shape[1] < max(tiles):
                raise ValueError(f"pixel_values {tuple(pixel_values.shape)} do not hold the tiles {tiles} of images of sizes {sizes}")
            return torch.cat([p[:n] for p, n in zip(pixel_values, tiles)])
        if pixel_values.dim() != 4 or pixel_values.shape[0] != sum(tiles):
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)} do not hold the tiles {tiles} of images of sizes {sizes}")
        return pixel_values

    def image_features(self, tiles: torch.Tensor, sizes, multi) -> torch.Tensor:
        """Every image's tiles back to back, the images' sizes and multi-image flags -> features
        [image tokens of all images, text_hidden_size] (`image_token_count` rows per image)."""
        counts = [num_image_tiles(self.cfg, h, w, m) for (h, w), m in zip(sizes, multi)]
        if self.cfg.vision_feature_select_strategy == "default" and max(counts, default=1) > 1:
            raise _default_strategy_refused()
        features = self.tile_features(tiles)
        return torch.cat([self.pack(f, size) for f, size in zip(features.split(counts), sizes)])

    def pack(self, features: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """One image's tile features [tiles, patches, hidden] -> its token features (HF's
        `pack_image_features` of one image)."""
        newline = self.image_newline.to(features.dtype)
        if features.shape[0] == 1:
            return torch.cat([features[0], newline[None]])
        side, hidden = self.cfg.tile_side, features.shape[-1]
        rows, cols = image_grid_shape(self.cfg, *size)
        grid = features[1:].view(rows, cols, side, side, hidden).permute(4, 0, 2, 1, 3).reshape(hidden, rows * side, cols * side)
        cut_h, cut_w = _unpadded(*size, rows * side, cols * side)
        grid = grid[:, cut_h : grid.shape[1] - cut_h, cut_w : grid.shape[2] - cut_w]
        shape = _downsampled(self.cfg, grid.shape[1], grid.shape[2])
        if shape is not None:
            grid = F.interpolate(grid[None], list(shape), mode="bilinear")[0]
        grid = torch.cat([grid, newline[:, None, None].expand(hidden, grid.shape[1], 1)], dim=-1)
        return torch.cat([features[0], grid.flatten(1).t()])

    def video_features(self, pixel_values_videos: torch.Tensor) -> torch.Tensor:
        """Videos [videos, frames, channels, size, size] -> features [video tokens of all videos,
        text_hidden_size] (HF's `get_video_features`, flattened as its forward does): each frame's
        patch map pooled bilinearly to half its side (rounded up), a newline after each video."""
        if self.cfg.vision_feature_select_strategy == "default":
            raise ValueError(
                "vision_feature_select_strategy 'default' drops a patch of each frame, which can't then be pooled (HF fails the same way)"
            )
        videos, frames = pixel_values_videos.shape[:2]
        x = self.tile_features(pixel_values_videos.flatten(0, 1))
        side, hidden = self.cfg.tile_side, x.shape[-1]
        x = x.view(videos * frames, side, side, hidden).permute(0, 3, 1, 2)
        x = F.interpolate(x, size=[math.ceil(side / 2)] * 2, mode="bilinear").permute(0, 2, 3, 1)
        x = x.reshape(videos, -1, hidden)
        newline = self.image_newline.to(x.dtype)[None, None].expand(videos, 1, hidden)
        return torch.cat([x, newline], dim=1).flatten(0, 1)
