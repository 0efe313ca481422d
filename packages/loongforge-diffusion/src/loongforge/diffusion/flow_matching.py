"""Rectified-flow (flow matching) training targets, as Wan and SD3 train.

A clean latent x0 and Gaussian noise e mix at noise level sigma in [0, 1]:
x_t = (1 - sigma) x0 + sigma e; the model, given x_t and the time t = 1000 sigma, predicts the
velocity e - x0. sigma comes from u in (0, 1) drawn by `timestep_sampling` (diffusers'
`compute_density_for_timestep_sampling`: uniform, logit_normal, mode) and then shifted toward
noise by `shift` as Wan's FlowMatchEulerDiscreteScheduler shifts its sampling schedule
(sigma = shift u / (1 + (shift - 1) u)). Each sample's loss is its mean squared velocity error
times a weight of sigma (diffusers' `compute_loss_weighting_for_sd3`: none, sigma_sqrt, cosmap).

Qwen-Image's size-dependent ("dynamic") shift replaces the static one where `training_shift` /
`sampling_shift` say `dynamic`: mu is a line in the image's token count through (base_seq_len,
base_shift) and (max_seq_len, max_shift) (diffusers' `calculate_shift`, as QwenImagePipeline
calls it with the published Qwen/Qwen-Image scheduler_config.json: 256 -> 0.5, 8192 -> 0.9,
`shift_terminal` 0.02) and sigma' = e^mu / (e^mu + 1/sigma - 1), i.e. a static shift of e^mu
(diffusers' exponential `time_shift`). Sampling (generate.py) builds diffusers' scheduler with
`use_dynamic_shifting` and gives it mu as the pipeline does. In training each sample of a packed
micro-batch takes mu from its own token count, as musubi-tuner's `--timestep_sampling
qwen_shift` does (no terminal stretch). The published Qwen-Image trainers do not shift by size
by default: diffusers' `train_dreambooth_lora_qwen_image.py` draws sigma from the published
scheduler's unshifted training sigmas (uniform u, no shift: `shift: 1`, `training_shift:
static`, which the shipped qwen_image_tiny follows); DiffSynth-Studio trains at a fixed mu of 0.8
(a static shift of e^0.8 = 2.23) with the terminal stretch; ai-toolkit's `shift` and
musubi-tuner's `qwen_shift` time samplings are opt-in size-dependent ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from loongforge.core.errors import UserError

SAMPLINGS = ("uniform", "logit_normal", "mode")
WEIGHTINGS = ("none", "sigma_sqrt", "cosmap")
SHIFT_MODES = ("static", "dynamic")


@dataclass
class DynamicShiftConfig:
    """Qwen-Image's size-dependent shift; the defaults are the published Qwen/Qwen-Image
    scheduler_config.json's (base_image_seq_len, max_image_seq_len, base_shift, max_shift,
    shift_terminal; `time_shift_type: exponential`, `use_dynamic_shifting: true`)."""

    base_seq_len: int = 256  # image tokens (packed 2x2 latent patches) where mu = base_shift
    max_seq_len: int = 8192  # image tokens where mu = max_shift (a line through both, extended beyond)
    base_shift: float = 0.5
    max_shift: float = 0.9
    shift_terminal: float = 0.02  # sampling: the schedule stretched to end at this sigma (0: not stretched)

    def validate(self, prefix: str) -> None:
        if not 1 <= self.base_seq_len < self.max_seq_len:
            raise UserError(
                f"{prefix}base_seq_len={self.base_seq_len} and {prefix}max_seq_len={self.max_seq_len}: "
                "need 1 <= base_seq_len < max_seq_len (Qwen-Image: 256, 8192)"
            )
        for name in ("base_shift", "max_shift"):
            if not math.isfinite(getattr(self, name)):
                raise UserError(f"{prefix}{name}={getattr(self, name)} must be a finite number (Qwen-Image: 0.5, 0.9)")
        if not 0 <= self.shift_terminal < 1:
            raise UserError(f"{prefix}shift_terminal={self.shift_terminal} must be in [0, 1) (0: no stretch; Qwen-Image: 0.02)")

    def mu(self, seq_len: int) -> float:
        """mu at `seq_len` image tokens."""
        return calculate_shift(seq_len, self.base_seq_len, self.max_seq_len, self.base_shift, self.max_shift)


def calculate_shift(seq_len, base_seq_len: int, max_seq_len: int, base_shift: float, max_shift: float):
    """diffusers' `calculate_shift` (QwenImagePipeline, Flux): the line through (base_seq_len,
    base_shift) and (max_seq_len, max_shift) at seq_len, in the same operations."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    b = base_shift - m * base_seq_len
    return seq_len * m + b


@dataclass
class FlowMatchingConfig:
    timestep_sampling: str = "uniform"  # uniform | logit_normal (SD3) | mode
    logit_mean: float = 0.0  # logit_normal
    logit_std: float = 1.0  # logit_normal
    mode_scale: float = 1.29  # mode
    shift: float = 5.0  # sigma = shift u / (1 + (shift - 1) u); Wan2.1 T2V samples with 5 (3 at 480p), 1: no shift
    # static: `shift` | dynamic: Qwen-Image's size-dependent shift (`dynamic_shift`), e^mu at each
    # training sample's own token count / at the generated image's (QwenImagePipeline)
    training_shift: str = "static"
    sampling_shift: str = "static"
    dynamic_shift: DynamicShiftConfig = field(default_factory=DynamicShiftConfig)
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
        for name in ("training_shift", "sampling_shift"):
            if getattr(self, name) not in SHIFT_MODES:
                raise UserError(
                    f"{prefix}{name}={getattr(self, name)!r}: choose static ({prefix}shift) or dynamic (Qwen-Image's size-dependent shift)"
                )
        self.dynamic_shift.validate(f"{prefix}dynamic_shift.")
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


def shift_sigma(u: torch.Tensor, shift: float | torch.Tensor) -> torch.Tensor:
    return shift * u / (1 + (shift - 1) * u)


def train_sigma(cfg: FlowMatchingConfig, u: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
    """The noise levels of draws u of samples of `seq_lens` image tokens: u shifted by `shift`,
    or (training_shift: dynamic) each by e^mu of its own token count, which is diffusers'
    exponential time shift e^mu / (e^mu + 1/u - 1) written without dividing by u."""
    if cfg.training_shift != "dynamic":
        return shift_sigma(u, cfg.shift)
    shifts = [math.exp(cfg.dynamic_shift.mu(n)) for n in seq_lens]
    return shift_sigma(u, torch.tensor(shifts, dtype=u.dtype, device=u.device))


def loss_weight(cfg: FlowMatchingConfig, sigma: torch.Tensor) -> torch.Tensor:
    if cfg.loss_weighting == "sigma_sqrt":
        return sigma.clamp_min(1e-6) ** -2.0
    if cfg.loss_weighting == "cosmap":
        return 2 / (math.pi * (1 - 2 * sigma + 2 * sigma**2))
    return torch.ones_like(sigma)


def noised(x0: torch.Tensor, noise: torch.Tensor, sigma: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_t, velocity target) of one sample at noise level sigma."""
    return (1 - sigma) * x0 + sigma * noise, noise - x0
