"""Learning-rate schedules: linear warmup, then cosine, linear, constant or WSD
(warmup-stable-decay: constant until the last `lr_wsd_decay_iters`, then linear to min_lr)."""

from __future__ import annotations

import math

from loongforge.core.errors import UserError

STYLES = ("cosine", "linear", "constant", "wsd")


def lr_at(step: int, cfg) -> float:
    """LR for optimizer step `step` (0-based) under a TrainConfig."""
    if cfg.lr_decay_style not in STYLES:
        raise UserError(f"train.lr_decay_style={cfg.lr_decay_style!r}: choose one of {', '.join(STYLES)}")
    warm, total = cfg.lr_warmup_iters, cfg.train_iters
    if warm > 0 and step < warm:
        return cfg.lr * (step + 1) / warm
    if cfg.lr_decay_style == "constant":
        return cfg.lr
    if cfg.lr_decay_style == "wsd":
        decay = cfg.lr_wsd_decay_iters or max(1, total // 10)
        start = total - decay
        if step < start:
            return cfg.lr
        frac = min(1.0, (step - start) / max(1, decay))
        return cfg.lr - (cfg.lr - cfg.min_lr) * frac
    frac = min(1.0, (step - warm) / max(1, total - warm))
    if cfg.lr_decay_style == "linear":
        return cfg.lr - (cfg.lr - cfg.min_lr) * frac
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * frac))
