"""Qwen3-VL's vision tower as a plain torch module on the op table, with its HF mapping table.

The math of HF `Qwen3VLVisionModel`: a patch embedding (with bias) of (temporal x spatial) pixel
patches plus learned position embeddings, a square grid bilinearly resampled (align_corners) to
each image's grid; pre-norm layers (LayerNorm, attention with fused qkv, biases and 2-D rotary
positions, a GELU-tanh MLP), every one attending over each whole frame; then the patch merger
(LayerNorm, each 2x2 block of patches concatenated, an exact-GELU MLP to the language model's
width). DeepStack: after each layer of `deepstack_visual_indexes` a merger of its own (its
LayerNorm after the 2x2 concatenation) turns that layer's output into features of the same shape,
which Qwen3-VL adds to early language-model layers. Images of any sizes run packed: every image's
patches in one row, in the processor's order (each merge block's patches together), attention
bounded by each frame's `cu_seqlens` (op `packed_attention`; a video's frames do not attend to
one another), rotary angles from each patch's (row, column) (op `rotary`).

HF names are relative to the tower (`model.visual.` in Qwen3-VL checkpoints; `hf_mapping.prefixed`
adds it).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from typing import List

import torch
import torch.nn.functional as F
from loongforge.core.accelerator import to_device
from loongforge.core.errors import UserError
from loongforge.core.foundation.hf_mapping import Row
from loongforge.core.foundation.qwen2_5_vl_vision import grid_rows, patch_positions, rope_tables
from loongforge.core.ops import OpTable
from torch import nn


@dataclass
class Qwen3VisionConfig:
    """The tower's shape under HF `Qwen3VLVisionConfig`'s names."""

    depth: int = 2
    hidden_size: int = 32
    intermediate_size: int = 48
    num_heads: int = 4
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 32
    num_position_embeddings: int = 16
    deepstack_visual_indexes: List[int] = field(default_factory=lambda: [0])
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def pos_side(self) -> int:
        """The side of the square grid of learned position embeddings."""
        return math.isqrt(self.num_position_embeddings)

    def repeats(self) -> dict[str, int]:
        return {"i": self.depth, "j": len(self.deepstack_visual_indexes)}

    def hf_config(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "rope_theta"}
        return {**d, "rope_parameters": {"rope_type": "axial", "rope_theta": self.rope_theta}}

    @classmethod
    def from_hf(cls, d: dict) -> "Qwen3VisionConfig":
        def bad(value: str, only: str) -> UserError:
            return UserError(f"Qwen3-VL vision config: {value} is not supported (only {only})")

        if d.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise bad(f"hidden_act={d['hidden_act']!r}", "gelu_pytorch_tanh")
        rope = d.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise bad(f"rope_type={rope['rope_type']!r}", "axial")
        for name in ("patch_size", "temporal_patch_size"):
            if not isinstance(d.get(name, 1), int):
                raise bad(f"{name}={d[name]!r}", "one int")
        known = {f.name for f in dataclasses.fields(cls)} - {"rope_theta"}
        cfg = cls(**{k: v for k, v in d.items() if k in known}, rope_theta=float(rope.get("rope_theta", 10000.0)))
        cfg.deepstack_visual_indexes = list(cfg.deepstack_visual_indexes)
        if cfg.pos_side**2 != cfg.num_position_embeddings:
            raise bad(f"num_position_embeddings={cfg.num_position_embeddings}", "a square grid")
        idx = cfg.deepstack_visual_indexes
        if len(set(idx)) != len(idx) or any(not 0 <= i < cfg.depth for i in idx):
            raise bad(f"deepstack_visual_indexes={idx}", f"distinct layers below depth={cfg.depth}")
        return cfg


V = "blocks.{i}."
D = "deepstack_mergers.{j}."
M = "deepstack_merger_list.{j}."

QWEN3_VISION_TABLE = (
    Row("patch_embed.weight", ("patch_embed.proj.weight",)),
    Row("patch_embed.bias", ("patch_embed.proj.bias",)),
    Row("pos_embed.weight", ("pos_embed.weight",)),
    Row(V + "norm1.weight", (V + "norm1.weight",)),
    Row(V + "norm1.bias", (V + "norm1.bias",)),
    Row(V + "qkv.weight", (V + "attn.qkv.weight",)),
    Row(V + "qkv.bias", (V + "attn.qkv.bias",)),
    Row(V + "proj.weight", (V + "attn.proj.weight",)),
    Row(V + "proj.bias", (V + "attn.proj.bias",)),
    Row(V + "norm2.weight", (V + "norm2.weight",)),
    Row(V + "norm2.bias", (V + "norm2.bias",)),
    Row(V + "fc1.weight", (V + "mlp.linear_fc1.weight",)),
    Row(V + "fc1.bias", (V + "mlp.linear_fc1.bias",)),
    Row(V + "fc2.weight", (V + "mlp.linear_fc2.weight",)),
    Row(V + "fc2.bias", (V + "mlp.linear_fc2.bias",)),
    Row("merger.norm.weight", ("merger.norm.weight",)),
    Row("merger.norm.bias", ("merger.norm.bias",)),
    Row("merger.fc1.weight", ("merger.linear_fc1.weight",)),
    Row("merger.fc1.bias", ("merger.linear_fc1.bias",)),
    Row("merger.fc2.weight", ("merger.linear_fc2.weight",)),
    Row("merger.fc2.bias", ("merger.linear_fc2.bias",)),
    Row(D + "norm.weight", (M + "norm.weight",)),
    Row(D + "norm.bias", (M + "norm.bias",)),
    Row(D + "fc1.weight", (M + "linear_fc1.weight",)),
    Row(D + "fc1.bias", (M + "linear_fc1.bias",)),
    Row(D + "fc2.weight", (M + "linear_fc2.weight",)),
    Row(D + "fc2.bias", (M + "linear_fc2.bias",)),
)


class VisionBlock(nn.Module):
    def __init__(self, cfg: Qwen3VisionConfig, ops: OpTable):
        super().__init__()
        d = cfg.hidden_size
        self.heads, self.ops = cfg.num_heads, ops
        self.norm1, self.norm2 = nn.LayerNorm(d, eps=1e-6), nn.LayerNorm(d, eps=1e-6)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, cfg.intermediate_size), nn.Linear(cfg.intermediate_size, d)

    def forward(self, x, cos, sin, cu, max_len):
        t, d = x.shape
        q, k, v = self.qkv(self.ops.layer_norm(x, self.norm1.weight, self.norm1.bias, 1e-6)).view(t, 3, self.heads, -1).unbind(1)
        q, k = self.ops.rotary(q, k, cos, sin, False)
        x = x + self.proj(self.ops.packed_attention(q, k, v, cu, cu, None, max_len, max_len).reshape(t, d))
        h = self.ops.layer_norm(x, self.norm2.weight, self.norm2.bias, 1e-6)
        return x + self.fc2(self.ops.gelu(self.fc1(h), "tanh"))


class PatchMerger(nn.Module):
    """Each merge block's patches concatenated, then an MLP; the LayerNorm runs per patch before
    the concatenation (the final merger) or on the concatenation (`postshuffle`: DeepStack's)."""

    def __init__(self, cfg: Qwen3VisionConfig, ops: OpTable, postshuffle: bool):
        super().__init__()
        merged = cfg.hidden_size * cfg.spatial_merge_size**2
        self.merged, self.postshuffle, self.ops = merged, postshuffle, ops
        self.norm = nn.LayerNorm(merged if postshuffle else cfg.hidden_size, eps=1e-6)
        self.fc1, self.fc2 = nn.Linear(merged, merged), nn.Linear(merged, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(-1, self.merged) if self.postshuffle else x
        x = self.ops.layer_norm(x, self.norm.weight, self.norm.bias, 1e-6).view(-1, self.merged)
        return self.fc2(self.ops.gelu(self.fc1(x)))


class Qwen3VisionTower(nn.Module):
    """`tower(pixel_values, grid_thw)`: the processor's flattened patches [patches, channels x
    temporal x patch x patch] and each image's (frames, rows, columns) in patches -> (merged
    features [patches / merge^2, out_hidden_size], [DeepStack features of the same shape, one per
    layer of `deepstack_visual_indexes`, in layer order]), in the processor's order."""

    def __init__(self, cfg: Qwen3VisionConfig, ops: OpTable | None = None):
        super().__init__()
        ops = ops or OpTable()
        self.cfg, self.ops = cfg, ops
        d, p = cfg.hidden_size, cfg.patch_size
        self.patch_embed = nn.Conv3d(cfg.in_channels, d, (cfg.temporal_patch_size, p, p), stride=(cfg.temporal_patch_size, p, p))
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, d)
        self.blocks = nn.ModuleList(VisionBlock(cfg, ops) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, ops, postshuffle=False)
        self.deepstack_mergers = nn.ModuleList(PatchMerger(cfg, ops, postshuffle=True) for _ in cfg.deepstack_visual_indexes)

    def pos_embeds(self, grid_thw) -> torch.Tensor:
        """The learned grid resampled to each image's (rows, columns), in the processor's order
        [patches, hidden]; fp32, as HF sums its interpolation taps in fp32."""
        side, m = self.cfg.pos_side, self.cfg.spatial_merge_size
        table = self.pos_embed.weight.float().view(side, side, -1).permute(2, 0, 1)[None]
        out = []
        for t, h, w in grid_thw:
            e = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0]
            e = e.permute(1, 2, 0).reshape(h // m, m, w // m, m, -1).transpose(1, 2).reshape(h * w, -1)
            out.append(e.repeat(t, 1))
        return torch.cat(out)

    def forward(self, pixel_values: torch.Tensor, grid_thw) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`grid_thw` a list or a host tensor (a device tensor costs a host sync)."""
        grid = grid_rows(grid_thw)
        if pixel_values.shape != (sum(t * h * w for t, h, w in grid), self.cfg.patch_dim):
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)} do not hold the patches of grid_thw {grid}")
        device = pixel_values.device
        weight = self.patch_embed.weight  # a stride-equals-kernel Conv3d on one patch each: a linear
        x = F.linear(pixel_values.to(weight.dtype), weight.flatten(1), self.patch_embed.bias)
        x = x + self.pos_embeds(grid).to(x.dtype)
        cos, sin = rope_tables(
            to_device(patch_positions(grid, self.cfg.spatial_merge_size), device), self.cfg.head_dim, self.cfg.rope_theta
        )
        frames = [h * w for t, h, w in grid for _ in range(t)]
        cu = to_device(torch.tensor([0, *itertools.accumulate(frames)], dtype=torch.int32), device)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, cu, max(frames))
            if i in self.cfg.deepstack_visual_indexes:
                deepstack.append(self.deepstack_mergers[self.cfg.deepstack_visual_indexes.index(i)](x))
        return self.merger(x), deepstack
