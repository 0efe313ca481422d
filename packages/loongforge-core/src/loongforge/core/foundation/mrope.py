"""Multimodal RoPE (M-RoPE, Qwen2-VL / Qwen2.5-VL): three position rows (time, height, width)
per token, each rotating its own section of the rotary channel pairs.

Text tokens get the same position on all three rows, counting on from the previous token;
a vision item (an image or a video, `grid` = (frames, rows, columns) of vision patches before the
2x2 merge) gets, per merged token, its frame (times `tokens_per_second * seconds_per_grid` for
videos), row and column offset by the position where it starts, and the text after it continues
from the start plus the item's largest merged side. Positions restart in every sample of a pack.

    pos = mrope_positions(token_types, image_grids, video_grids, spatial_merge=2)   # [3, tokens]
    cos, sin = mrope_tables(pos, inv_freq, sections=(16, 24, 24))                  # op `rotary`'s tables
"""

from __future__ import annotations

import itertools

import torch

TEXT, IMAGE, VIDEO = 0, 1, 2


def mrope_positions(
    token_types,
    image_grids=(),
    video_grids=(),
    seconds_per_grid=(),
    spatial_merge: int = 2,
    tokens_per_second: float = 2,
) -> torch.Tensor:
    """Position rows [3, tokens] of one sample whose tokens are `token_types` (TEXT, IMAGE or VIDEO
    per token; each run of IMAGE / VIDEO tokens is the next image / video, as many tokens as its
    grid has merged patches)."""
    types = [int(t) for t in token_types]
    items = {IMAGE: iter(image_grids), VIDEO: iter(video_grids)}
    seconds = iter(seconds_per_grid)
    rows, pos, i = [], 0, 0
    while i < len(types):
        kind, j = types[i], i
        while j < len(types) and types[j] == kind:
            j += 1
        if kind == TEXT:
            rows.append(torch.arange(pos, pos + j - i).expand(3, -1))
            pos += j - i
        else:
            t, h, w = (int(v) for v in next(items[kind]))
            h, w = h // spatial_merge, w // spatial_merge
            if t * h * w != j - i:
                raise ValueError(f"a run of {j - i} vision tokens at {i} for a grid of {t * h * w} merged patches")
            step = tokens_per_second * float(next(seconds)) if kind == VIDEO else 1
            frames = (torch.arange(t) * step).long() + pos
            grid = torch.meshgrid(frames, torch.arange(h) + pos, torch.arange(w) + pos, indexing="ij")
            rows.append(torch.stack(grid).reshape(3, -1))
            pos += max(h, w)
        i = j
    return torch.cat(rows, dim=1) if rows else torch.zeros(3, 0, dtype=torch.long)


def mrope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, sections, interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin [tokens, 1, rot / 2] for op `rotary` (half-split pairs, as HF rotates): channel pair
    c takes its angle from the position row of the section it falls in (time, height, width), or
    with `interleaved` (Qwen3-VL) from row c % 3 among the first 3 x section pairs of that row
    (the time row elsewhere)."""
    if sum(sections) != inv_freq.numel():
        raise ValueError(f"mrope sections {list(sections)} must sum to the {inv_freq.numel()} rotary pairs")
    inv = inv_freq.float().to(positions.device)
    # slices only: no index tensor to copy to the device (a host sync per forward)
    if interleaved:
        angles = positions[0].float()[:, None] * inv
        for r in (1, 2):
            picked = slice(r, 3 * sections[r], 3)
            angles[:, picked] = positions[r].float()[:, None] * inv[picked]
    else:
        bounds = [0, *itertools.accumulate(sections)]
        parts = [positions[r].float()[:, None] * inv[a:b] for r, (a, b) in enumerate(zip(bounds, bounds[1:])) if b > a]
        angles = torch.cat(parts, dim=1)  # [tokens, rot/2]
    return angles.cos()[:, None], angles.sin()[:, None]
