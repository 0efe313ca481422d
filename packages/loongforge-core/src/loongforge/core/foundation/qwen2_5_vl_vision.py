"""Qwen2.5-VL's vision tower as a plain torch module on the op table, with its HF mapping table.

The math of HF `Qwen2_5_VisionTransformerPretrainedModel`: a patch embedding of (temporal x
spatial) pixel patches; pre-norm layers (RMSNorm, attention with 2-D rotary positions, a SwiGLU
MLP with biases), most attending inside windows of `window_size` pixels and the layers of
`fullatt_block_indexes` over each whole image; then the patch merger (RMSNorm, each 2x2 block of
patches concatenated, a GELU MLP to the language model's width). Images of any sizes run packed:
every image's patches in one row, attention bounded by each window's or image's `cu_seqlens`
(op `packed_attention`), rotary angles from each patch's (row, column) (op `rotary`).

Patches run in window order (HF's `window_index`: each merge block's patches together, blocks
window by window), the merger outputs go back to the image order at the end. HF names are
relative to the tower (`visual.` in Qwen2.5-VL checkpoints; `hf_mapping.prefixed` adds it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import List

import torch
import torch.nn.functional as F
from loongforge.core.errors import UserError
from loongforge.core.foundation.hf_mapping import Row
from loongforge.core.ops import OpTable
from torch import nn


@dataclass
class Qwen25VisionConfig:
    """The tower's shape under HF `Qwen2_5_VLVisionConfig`'s names."""

    depth: int = 2
    hidden_size: int = 32
    intermediate_size: int = 48
    num_heads: int = 4
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    window_size: int = 112
    out_hidden_size: int = 32
    fullatt_block_indexes: List[int] = field(default_factory=lambda: [1])
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    def repeats(self) -> dict[str, int]:
        return {"i": self.depth}

    def hf_config(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "rope_theta"}
        return {**d, "hidden_act": "silu", "rope_parameters": {"rope_type": "axial", "rope_theta": self.rope_theta}}

    @classmethod
    def from_hf(cls, d: dict) -> "Qwen25VisionConfig":
        if d.get("hidden_act", "silu") != "silu":
            raise UserError(f"Qwen2.5-VL vision config: hidden_act={d['hidden_act']!r} is not supported (only silu)")
        rope = d.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise UserError(f"Qwen2.5-VL vision config: rope_type={rope['rope_type']!r} is not supported (only axial)")
        known = {f.name for f in dataclasses.fields(cls)} - {"rope_theta"}
        cfg = cls(**{k: v for k, v in d.items() if k in known}, rope_theta=float(rope.get("rope_theta", 10000.0)))
        cfg.fullatt_block_indexes = list(cfg.fullatt_block_indexes)
        return cfg


V = "blocks.{i}."

QWEN25_VISION_TABLE = (
    Row("patch_embed", ("patch_embed.proj.weight",)),
    Row(V + "norm1", (V + "norm1.weight",)),
    Row(V + "qkv.weight", (V + "attn.qkv.weight",)),
    Row(V + "qkv.bias", (V + "attn.qkv.bias",)),
    Row(V + "proj.weight", (V + "attn.proj.weight",)),
    Row(V + "proj.bias", (V + "attn.proj.bias",)),
    Row(V + "norm2", (V + "norm2.weight",)),
    Row(V + "gate_up.weight", (V + "mlp.gate_proj.weight", V + "mlp.up_proj.weight"), "concat"),
    Row(V + "gate_up.bias", (V + "mlp.gate_proj.bias", V + "mlp.up_proj.bias"), "concat"),
    Row(V + "down.weight", (V + "mlp.down_proj.weight",)),
    Row(V + "down.bias", (V + "mlp.down_proj.bias",)),
    Row("merger_norm", ("merger.ln_q.weight",)),
    Row("merger_fc1.weight", ("merger.mlp.0.weight",)),
    Row("merger_fc1.bias", ("merger.mlp.0.bias",)),
    Row("merger_fc2.weight", ("merger.mlp.2.weight",)),
    Row("merger_fc2.bias", ("merger.mlp.2.bias",)),
)


@dataclass
class VisionLayout:
    """Where each patch of a pack of images runs: `order` puts the patches (in the processor's
    order) into window order; `cu_window` / `cu_image` bound each window / image in that order;
    `pos` is each patch's (row, column) in window order (its rotary position)."""

    order: torch.Tensor
    unmerge: torch.Tensor  # the merger's rows (merge blocks in window order) back to the processor's order
    cu_window: torch.Tensor
    cu_image: torch.Tensor
    pos: torch.Tensor
    max_window: int
    max_image: int

    def to(self, device) -> "VisionLayout":
        """On `device`, copied from pinned host memory without waiting for the device's queue."""
        from loongforge.core.accelerator import to_device

        return dataclasses.replace(self, **{f.name: to_device(getattr(self, f.name), device) for f in dataclasses.fields(self)})


def grid_rows(grid_thw) -> list[tuple[int, int, int]]:
    """(frames, rows, columns) of each item as ints, from a list or a tensor (a device tensor
    costs a host sync: keep grids on the host)."""
    rows = grid_thw.tolist() if torch.is_tensor(grid_thw) else grid_thw
    return [tuple(int(v) for v in g) for g in rows]


def patch_positions(grid_thw, merge: int) -> torch.Tensor:
    """Each patch's (row, column) [patches, 2] (int32, on the host) in the processor's order: each
    merge block's patches together, every frame of an item alike."""
    pos = []
    for t, h, w in grid_rows(grid_thw):
        hh = torch.arange(h)[:, None].expand(h, w).reshape(h // merge, merge, w // merge, merge).transpose(1, 2).reshape(-1)
        ww = torch.arange(w)[None, :].expand(h, w).reshape(h // merge, merge, w // merge, merge).transpose(1, 2).reshape(-1)
        pos.append(torch.stack([hh, ww], dim=-1).repeat(t, 1))
    return torch.cat(pos).to(torch.int32)


def rope_tables(pos: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The 2-D rotary tables of patches at `pos` [patches, 2]: cos / sin [patches, 1, head_dim / 2],
    the row's and the column's angles side by side."""
    half = head_dim // 2
    inv = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float, device=pos.device) / half))
    pos = pos.float()
    angles = torch.cat([pos[:, :1] * inv, pos[:, 1:] * inv], dim=-1)
    return angles.cos()[:, None], angles.sin()[:, None]


def vision_layout(cfg: Qwen25VisionConfig, grid_thw) -> VisionLayout:
    """HF's window index, bounds and rotary positions for images of `grid_thw` (frames, rows,
    columns in patches), built on the host (`.to(device)` moves it)."""
    m = cfg.spatial_merge_size
    unit = m * m
    win = cfg.window_size // m // cfg.patch_size  # a window's side in merge blocks
    order, cu_window, cu_image, base = [], [0], [0], 0
    for t, h, w in grid_rows(grid_thw):
        gh, gw = h // m, w // m
        index = torch.arange(t * gh * gw).reshape(t, gh, gw)
        ph, pw = -gh % win, -gw % win
        padded = F.pad(index, (0, pw, 0, ph), value=-1)
        nh, nw = (gh + ph) // win, (gw + pw) // win
        padded = padded.reshape(t, nh, win, nw, win).permute(0, 1, 3, 2, 4).reshape(t, nh * nw, win * win)
        for row in padded.reshape(-1, win * win):
            kept = row[row >= 0]
            if len(kept):
                order.append(kept + base)
                cu_window.append(cu_window[-1] + len(kept) * unit)
        for _ in range(t):
            cu_image.append(cu_image[-1] + h * w)
        base += t * gh * gw
    merged = torch.cat(order)
    patches = (merged[:, None] * unit + torch.arange(unit)).reshape(-1)
    windows = torch.tensor(cu_window, dtype=torch.int32)
    return VisionLayout(
        patches,
        torch.argsort(merged),
        windows,
        torch.tensor(cu_image, dtype=torch.int32),
        patch_positions(grid_thw, m)[patches],
        int(torch.diff(windows).max()),
        max(h * w for _, h, w in grid_rows(grid_thw)),
    )


class VisionBlock(nn.Module):
    def __init__(self, cfg: Qwen25VisionConfig, ops: OpTable):
        super().__init__()
        d = cfg.hidden_size
        self.heads, self.ops = cfg.num_heads, ops
        self.norm1, self.norm2 = nn.Parameter(torch.ones(d)), nn.Parameter(torch.ones(d))
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.gate_up, self.down = nn.Linear(d, 2 * cfg.intermediate_size), nn.Linear(cfg.intermediate_size, d)

    def forward(self, x, cos, sin, cu, max_len):
        t, d = x.shape
        q, k, v = self.qkv(self.ops.rms_norm(x, self.norm1, 1e-6)).view(t, 3, self.heads, -1).unbind(1)
        q, k = self.ops.rotary(q, k, cos, sin, False)
        x = x + self.proj(self.ops.packed_attention(q, k, v, cu, cu, None, max_len, max_len).reshape(t, d))
        return x + self.down(self.ops.swiglu(self.gate_up(self.ops.rms_norm(x, self.norm2, 1e-6))))


class Qwen25VisionTower(nn.Module):
    """`tower(pixel_values, grid_thw)`: the processor's flattened patches [patches, channels x
    temporal x patch x patch] and each image's (frames, rows, columns) in patches -> merged
    features [patches / merge^2, out_hidden_size], in the processor's order."""

    def __init__(self, cfg: Qwen25VisionConfig, ops: OpTable | None = None):
        super().__init__()
        ops = ops or OpTable()
        self.cfg, self.ops = cfg, ops
        d = cfg.hidden_size
        self.patch_embed = nn.Parameter(torch.empty(d, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size))
        nn.init.normal_(self.patch_embed, std=0.02)
        self.blocks = nn.ModuleList(VisionBlock(cfg, ops) for _ in range(cfg.depth))
        merged = d * cfg.spatial_merge_size**2
        self.merger_norm = nn.Parameter(torch.ones(d))
        self.merger_fc1, self.merger_fc2 = nn.Linear(merged, merged), nn.Linear(merged, cfg.out_hidden_size)

    def forward(self, pixel_values: torch.Tensor, grid_thw, layout: VisionLayout | None = None) -> torch.Tensor:
        """`layout`: `vision_layout(cfg, grid_thw)` on the pixels' device, where the caller made it
        ahead (built here otherwise)."""
        grid = grid_rows(grid_thw)
        if pixel_values.shape != (sum(t * h * w for t, h, w in grid), self.cfg.patch_dim):
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)} do not hold the patches of grid_thw {grid}")
        layout = layout if layout is not None else vision_layout(self.cfg, grid).to(pixel_values.device)
        x = F.linear(pixel_values.to(self.patch_embed.dtype), self.patch_embed.flatten(1))[layout.order]
        cos, sin = rope_tables(layout.pos, self.cfg.head_dim, self.cfg.rope_theta)
        full = set(self.cfg.fullatt_block_indexes)
        for i, block in enumerate(self.blocks):
            cu, longest = (layout.cu_image, layout.max_image) if i in full else (layout.cu_window, layout.max_window)
            x = block(x, cos, sin, cu, longest)
        x = self.ops.rms_norm(x, self.merger_norm, 1e-6).view(-1, self.merger_fc1.in_features)
        merged = self.merger_fc2(self.ops.gelu(self.merger_fc1(x)))
        return merged[layout.unmerge]
