"""Rectified-flow (flow matching) training targets, as Wan and SD3 train.

A clean latent x0 and Gaussian noise e mix at noise level sigma in [0, 1]:
x_t = (1 - sigma) x0 + sigma e; the model, given x_t and the time t = 1000 sigma, predicts the
velocity e - x0. sigma comes from u in (0, 1) drawn by `timestep_sampling` (diffusers'
`compute_density_for_timestep_sampling`: uniform, logit_normal, mode) and then shifted toward
noise by `shift` as Wan's FlowMatchEulerDiscreteScheduler shifts its sampling schedule
(sigma = shift u / (1 + (shift - 1) u)). Each sample's loss is its mean squared velocity error
times a weight of sigma (diffusers' `compute_loss_weighting_for_sd3`: none, sigma_sqrt, cosmap).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from loongforge.core.errors import UserError

SAMPLINGS = ("uniform", "logit_normal", "mode")
WEIGHTINGS = ("none", "sigma_sqrt", "cosmap")


@dataclass
class FlowMatchingConfig:
    timestep_sampling: str = "uniform"  # uniform | logit_normal (SD3) | mode
    logit_mean: float = 0.0  # logit_normal
    logit_std: float = 1.0  # logit_normal
    mode_scale: float = 1.29  # mode
    shift: float = 5.0  # sigma = shift u / (1 + (shift - 1) u); Wan2.1 T2V samples with 5 (3 at 480p), 1: no shift
    loss_weighting: str = "none"  # none | sigma_sqrt | cosmap
    caption_dropout: float = 0.1  # share of samples trained on the empty prompt (classifier-free guidance)
    num_train_timesteps: int = 1000  # the model's time input is sigma times this
    # Wan2.2 TI2V: the share of samples conditioned on their first frame (kept clean: its latent
    # tokens at time 0 and out of the loss), the rest text-to-video; 0: text-to-video only
    first_frame_condition: float = 0.0

    def validate(self, prefix: str = "flow.") -> None:
        if self.timestep_sampling not in SAMPLINGS:
            raise UserError(f"{prefix}timestep_sampling={self.timestep_sampling!r}: choose one of {', '.join(SAMPLINGS)}")
        if self.loss_weighting not in WEIGHTINGS:
            raise UserError(f"{prefix}loss_weighting={self.loss_weighting!r}: choose one of {', '.join(WEIGHTINGS)}")
        if not (math.isfinite(self.shift) and self.shift > 0):
            raise UserError(f"{prefix}shift={self.shift} must be positive (1: no shift)")
        if not 0 <= self.caption_dropout < 1:
            raise UserError(f"{prefix}caption_dropout={self.caption_dropout} must be in [0, 1)")
        if not 0 <= self.first_frame_condition <= 1:
            raise UserError(f"{prefix}first_frame_condition={self.first_frame_condition} must be in [0, 1]")
        if self.logit_std <= 0:
            raise UserError(f"{prefix}logit_std={self.logit_std} must be positive")


def sample_u(cfg: FlowMatchingConfig, n: int, generator: torch.Generator, device) -> torch.Tensor:
    """n draws of u in (0, 1) by the configured density."""
    if cfg.timestep_sampling == "logit_normal":
        return torch.sigmoid(torch.normal(cfg.logit_mean, cfg.logit_std, (n,), generator=generator, device=device))
    u = torch.rand(n, generator=generator, device=device)
    if cfg.timestep_sampling == "mode":
        u = 1 - u - cfg.mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    return u


def shift_sigma(u: torch.Tensor, shift: float) -> torch.Tensor:
    return shift * u / (1 + (shift - 1) * u)


def loss_weight(cfg: FlowMatchingConfig, sigma: torch.Tensor) -> torch.Tensor:
    if cfg.loss_weighting == "sigma_sqrt":
        return sigma.clamp_min(1e-6) ** -2.0
    if cfg.loss_weighting == "cosmap":
        return 2 / (math.pi * (1 - 2 * sigma + 2 * sigma**2))
    return torch.ones_like(sigma)


def noised(x0: torch.Tensor, noise: torch.Tensor, sigma: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_t, velocity target) of one sample at noise level sigma."""
    return (1 - sigma) * x0 + sigma * noise, noise - x0
