"""pi0 and pi0.5: flow-matching vision-language-action policies on PaliGemma plus an action expert.

The model (the pi0 and pi0.5 papers; LeRobot's `PI0Policy` / `PI05Policy` and openpi's PyTorch
port are the reference implementations this follows):
- prefix: each camera's image through SigLIP and a linear projector, then the prompt's token
  embeddings (scaled by sqrt(width), Gemma's convention); the prefix attends bidirectionally to
  itself and never to the suffix.
- suffix, run by the action expert (a smaller Gemma): the noisy action chunk through
  `action_in_proj`. pi0.5 conditions every expert norm on the flow-matching time (adaptive
  RMSNorm, `time_mlp_in` / `time_mlp_out` over a sinusoidal embedding) and carries the
  discretized state in the prompt; pi0 adds a state token (`state_proj`) and fuses the time into
  each action token (`action_time_mlp_in` / `_out`).
- both decoders run layer by layer through one joint attention over [prefix | suffix] with the
  block mask of the papers: a token sees every token of its own block and of earlier blocks (so
  the prefix's rows are an attention of the prefix alone; `joint` runs them as one).
- loss: x_t = t * noise + (1 - t) * actions, target u = noise - actions, squared error of the
  expert's prediction; t ~ Beta(1.5, 1) * 0.999 + 0.001.
- sampling: Euler from t = 1 to 0 in `num_inference_steps`, the prefix's keys and values computed
  once and reused by every step.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from loongforge.core.accelerator.cuda_graph import GraphedCall
from loongforge.core.errors import UserError
from loongforge.core.foundation.gemma import GemmaConfig, GemmaModel, attention_bias, masked_attention
from loongforge.core.foundation.siglip import SiglipVisionConfig, SiglipVisionTower
from loongforge.core.ops import OpTable
from torch import nn

VARIANTS = ("pi05", "pi0")


@dataclass
class PiConfig:
    """A pi0 / pi0.5 policy's shape and flow-matching settings (defaults: LeRobot's)."""

    variant: str = "pi05"
    vision: SiglipVisionConfig = field(default_factory=SiglipVisionConfig)
    backbone: GemmaConfig = field(default_factory=GemmaConfig)
    expert: GemmaConfig = field(default_factory=lambda: GemmaConfig(hidden_size=32, ffn_hidden_size=64))
    chunk_size: int = 50
    max_action_dim: int = 32
    max_state_dim: int = 32
    num_inference_steps: int = 10
    time_beta_alpha: float = 1.5
    time_beta_beta: float = 1.0
    time_scale: float = 0.999
    time_offset: float = 0.001
    min_period: float = 4e-3
    max_period: float = 4.0

    def resolved(self) -> "PiConfig":
        """pi0.5's expert conditions its norms on a vector as wide as itself unless told otherwise."""
        if self.variant == "pi05" and not self.expert.adarms_cond_dim:
            return dataclasses.replace(self, expert=dataclasses.replace(self.expert, adarms_cond_dim=self.expert.hidden_size))
        return self

    def check(self) -> None:
        if self.variant not in VARIANTS:
            raise UserError(f"policy.variant={self.variant!r}: expected one of {', '.join(VARIANTS)}")
        b, e = self.backbone, self.expert
        for name in ("num_layers", "num_attention_heads", "num_query_groups", "head_dim"):
            if getattr(b, name) != getattr(e, name):
                raise UserError(
                    f"policy.expert.{name}={getattr(e, name)} must equal policy.backbone.{name}={getattr(b, name)}: "
                    "the two decoders share each layer's attention"
                )
        wants_ada = self.variant == "pi05"
        if bool(e.adarms_cond_dim) != wants_ada or b.adarms_cond_dim:
            raise UserError(
                f"policy.variant={self.variant}: the expert's adaptive norms must be "
                f"{'on (expert.adarms_cond_dim = expert.hidden_size)' if wants_ada else 'off'} and the backbone's off"
            )
        if e.hidden_size % 2:
            raise UserError(f"policy.expert.hidden_size={e.hidden_size} must be even (sinusoidal time embedding)")
        if self.chunk_size < 1 or self.num_inference_steps < 1:
            raise UserError("policy.chunk_size and policy.num_inference_steps must be at least 1")


def time_embedding(t: torch.Tensor, dim: int, min_period: float, max_period: float) -> torch.Tensor:
    """Sine-cosine embedding [b, dim] of scalar times t [b], periods geometric in [min, max]
    (computed in fp64 where the device has it, as the reference does)."""
    dtype = torch.float32 if t.device.type == "mps" else torch.float64
    fraction = torch.linspace(0.0, 1.0, dim // 2, dtype=dtype, device=t.device)
    period = min_period * (max_period / min_period) ** fraction
    angle = (2 * math.pi / period)[None, :] * t[:, None].to(dtype)
    return torch.cat([angle.sin(), angle.cos()], dim=1).to(t.dtype)


def block_mask(pad: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """bool [b, n, n]: query i may attend key j when j is not padding, i is not padding, and j's
    block is not after i's (`starts` [b, n]: 1 where a token opens a new block)."""
    block = torch.cumsum(starts.to(torch.int32), dim=1)
    return (block[:, None, :] <= block[:, :, None]) & pad[:, None, :] & pad[:, :, None]


@dataclass
class Observation:
    """A batch of policy inputs, already preprocessed: images [b, cameras, 3, H, W] in [-1, 1]
    (H = W = the vision tower's size), image_masks [b, cameras] (False: a missing camera), the
    prompt's tokens [b, L] and token_masks [b, L], and for pi0 the normalized state [b, state_dim]."""

    images: torch.Tensor
    image_masks: torch.Tensor
    tokens: torch.Tensor
    token_masks: torch.Tensor
    state: Optional[torch.Tensor] = None


class PiPolicy(nn.Module):
    def __init__(self, cfg: PiConfig, ops: OpTable | None = None):
        super().__init__()
        cfg = cfg.resolved()
        cfg.check()
        ops = ops or OpTable()
        self.cfg = cfg
        width = cfg.expert.hidden_size
        self.vision = SiglipVisionTower(cfg.vision, ops)
        self.projector = nn.Linear(cfg.vision.hidden_size, cfg.backbone.hidden_size)
        self.backbone = GemmaModel(cfg.backbone, ops)
        self.expert = GemmaModel(cfg.expert, ops, embedding=False)
        self.action_in_proj = nn.Linear(cfg.max_action_dim, width)
        self.action_out_proj = nn.Linear(width, cfg.max_action_dim)
        if cfg.variant == "pi05":
            self.time_mlp_in = nn.Linear(width, width)
            self.time_mlp_out = nn.Linear(width, width)
        else:
            self.state_proj = nn.Linear(cfg.max_state_dim, width)
            self.action_time_mlp_in = nn.Linear(2 * width, width)
            self.action_time_mlp_out = nn.Linear(width, width)

    # ---- embeddings
    def embed_prefix(self, obs: Observation) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(embeddings [b, n, backbone width], pad [b, n], block starts [b, n]): one block."""
        b, cams = obs.images.shape[:2]
        patches = self.projector(self.vision(obs.images.flatten(0, 1)))  # every camera in one call
        patches = patches.reshape(b, cams * patches.shape[1], -1)
        per_image = patches.shape[1] // cams
        words = self.backbone.embed(obs.tokens)
        emb = torch.cat([patches, words.to(patches.dtype)], dim=1)
        image_pad = obs.image_masks[:, :, None].expand(b, cams, per_image).reshape(b, cams * per_image)
        pad = torch.cat([image_pad, obs.token_masks.bool()], dim=1)
        return emb, pad, torch.zeros_like(pad, dtype=torch.int32)

    def embed_suffix(self, noisy: torch.Tensor, t: torch.Tensor, state: torch.Tensor | None):
        """(embeddings [b, m, expert width], pad, block starts, adaRMS condition or None)."""
        cfg = self.cfg
        temb = time_embedding(t, cfg.expert.hidden_size, cfg.min_period, cfg.max_period)
        actions = self.action_in_proj(noisy.to(self.action_in_proj.weight.dtype))
        b, chunk = actions.shape[:2]
        starts = torch.zeros(b, chunk, dtype=torch.int32, device=noisy.device)
        starts[:, 0] = 1  # the action chunk is one block after the prefix
        if cfg.variant == "pi05":
            cond = F.silu(self.time_mlp_out(F.silu(self.time_mlp_in(temb.to(self.time_mlp_in.weight.dtype)))))
            return actions, torch.ones(b, chunk, dtype=torch.bool, device=noisy.device), starts, cond
        if state is None:
            raise UserError("pi0 needs observation.state (its state token)")
        fused = torch.cat([actions, temb[:, None, :].expand_as(actions).to(actions.dtype)], dim=2)
        actions = self.action_time_mlp_out(F.silu(self.action_time_mlp_in(fused)))
        state_tok = self.state_proj(state.to(self.state_proj.weight.dtype))[:, None, :]
        emb = torch.cat([state_tok.to(actions.dtype), actions], dim=1)
        starts = torch.cat([torch.ones(b, 1, dtype=torch.int32, device=noisy.device), starts], dim=1)
        return emb, torch.ones(b, chunk + 1, dtype=torch.bool, device=noisy.device), starts, None

    # ---- the joint decoder
    def joint(self, prefix, suffix, mask, positions, cond) -> torch.Tensor:
        """Both decoders over [prefix | suffix] through shared attention; the expert's final
        hidden states [b, m, width]. The block mask keeps the prefix from the suffix, so the
        prefix's queries attend to the prefix alone and only the suffix's attend to [prefix |
        suffix] (the joint attention's rows, without concatenating queries or splitting outputs;
        a padded prefix row, which no real token reads, averages over the prefix only). The
        prefix's last attention, MLP and final norm feed nothing the policy reads: not run."""
        n = prefix.shape[1]
        pos_p, pos_s = positions[:, :n], positions[:, n:]
        mask_p, mask_s = attention_bias(mask[:, :n, :n], prefix.dtype), attention_bias(mask[:, n:], prefix.dtype)
        layers = list(zip(self.backbone.layers, self.expert.layers))
        for idx, (lp, ls) in enumerate(layers):
            qp, kp, vp, gp = lp(prefix, pos_p, self.backbone.inv_freq, phase="inputs")
            qs, ks, vs, gs = ls(suffix, pos_s, self.expert.inv_freq, cond=cond, phase="inputs")
            if idx < len(layers) - 1:
                prefix = lp(prefix, attn=masked_attention(qp, kp, vp, mask_p), gate=gp, phase="finish")
            attn = masked_attention(qs, torch.cat([kp, ks], 2), torch.cat([vp, vs], 2), mask_s)
            suffix = ls(suffix, cond=cond, attn=attn, gate=gs, phase="finish")
        return self.expert.final_norm(suffix, cond)[0]

    def predict_velocity(self, obs: Observation, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The expert's velocity [b, chunk, max_action_dim] for noisy actions x_t at times t."""
        p_emb, p_pad, p_starts = self.embed_prefix(obs)
        s_emb, s_pad, s_starts, cond = self.embed_suffix(x_t, t, obs.state)
        pad = torch.cat([p_pad, s_pad], dim=1)
        mask = block_mask(pad, torch.cat([p_starts, s_starts], dim=1))
        positions = torch.cumsum(pad.to(torch.int64), dim=1) - 1
        out = self.joint(p_emb, s_emb.to(p_emb.dtype), mask, positions, cond)
        return self.action_out_proj(out[:, -self.cfg.chunk_size :].to(self.action_out_proj.weight.dtype))

    # ---- training
    def sample_time(self, b: int, device, generator: torch.Generator | None = None) -> torch.Tensor:
        c = self.cfg
        # Beta(a, b) as X / (X + Y) with X ~ Gamma(a), Y ~ Gamma(b): torch's Beta takes no generator
        x = torch._standard_gamma(torch.full((b,), c.time_beta_alpha, device=device), generator=generator)
        y = torch._standard_gamma(torch.full((b,), c.time_beta_beta, device=device), generator=generator)
        return (x / (x + y)) * c.time_scale + c.time_offset

    def flow_matching_loss(
        self, obs: Observation, actions: torch.Tensor, noise: torch.Tensor | None = None, t: torch.Tensor | None = None, generator=None
    ) -> torch.Tensor:
        """Per-element squared error [b, chunk, max_action_dim] of the predicted velocity;
        actions [b, chunk, max_action_dim] normalized (and zero-padded to max_action_dim)."""
        if noise is None:
            noise = torch.randn(actions.shape, generator=generator, device=actions.device, dtype=torch.float32)
        if t is None:
            t = self.sample_time(actions.shape[0], actions.device, generator)
        te = t[:, None, None]
        x_t = te * noise + (1 - te) * actions
        v_t = self.predict_velocity(obs, x_t, t)
        return (noise - actions - v_t.float()) ** 2

    def forward(self, obs: Observation, actions: torch.Tensor, noise=None, t=None, generator=None) -> torch.Tensor:
        """The training loss (`flow_matching_loss`): in the module call, so that the data-parallel
        wrappers' root hooks (FSDP's parameter gathering) run around it."""
        return self.flow_matching_loss(obs, actions, noise, t, generator)

    # ---- inference
    @torch.no_grad()
    def sample_actions(
        self, obs: Observation, noise: torch.Tensor | None = None, num_steps: int | None = None, generator=None
    ) -> torch.Tensor:
        """Euler integration of the velocity from noise (t = 1) to actions (t = 0): [b, chunk,
        max_action_dim]. The prefix runs once; each step runs the expert against its cache."""
        cfg = self.cfg
        steps = num_steps or cfg.num_inference_steps
        b = obs.tokens.shape[0]
        device = obs.tokens.device
        if noise is None:
            noise = torch.randn(b, cfg.chunk_size, cfg.max_action_dim, generator=generator, device=device)
        p_emb, p_pad, p_starts = self.embed_prefix(obs)
        p_pos = torch.cumsum(p_pad.to(torch.int64), dim=1) - 1
        cache = self.prefix_cache(p_emb, block_mask(p_pad, p_starts), p_pos)
        x_t, dt = noise, -1.0 / steps
        for step in range(steps):
            t = torch.full((b,), 1.0 + step * dt, dtype=torch.float32, device=device)
            x_t = x_t + dt * self.cached_velocity(cache, p_pad, x_t, t, obs.state).float()
        return x_t

    def graphed_sampler(self, max_graphs: int = 4) -> Callable[[Observation, torch.Tensor], torch.Tensor]:
        """`sampler(obs, noise)`: `sample_actions(obs, noise)` replayed from a CUDA graph captured
        once per input shape (eager off CUDA). The same kernels as the eager call, launched as one
        graph: an action chunk at batch 1 is bound by kernel launches, not by the GPU. The graph
        reads the parameters where they are: load new weights in place (`load_state_dict`), not
        by moving or casting the module."""

        def run(images, image_masks, tokens, token_masks, noise, *state):
            obs = Observation(images, image_masks, tokens, token_masks, state[0] if state else None)
            return self.sample_actions(obs, noise=noise)

        graphed = GraphedCall(run, max_graphs)

        def sampler(obs: Observation, noise: torch.Tensor) -> torch.Tensor:
            state = () if obs.state is None else (obs.state,)
            return graphed(obs.images, obs.image_masks, obs.tokens, obs.token_masks, noise, *state)

        return sampler

    def prefix_cache(self, emb, mask, positions) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's prefix keys and values, from the backbone alone (the prefix never sees
        the suffix, so these are the joint pass's own)."""
        cache, layers = [], self.backbone.layers
        mask = attention_bias(mask, emb.dtype)
        for idx, layer in enumerate(layers):
            q, k, v, gate = layer(emb, positions, self.backbone.inv_freq, phase="inputs")
            cache.append((k, v))
            if idx < len(layers) - 1:
                emb = layer(emb, attn=masked_attention(q, k, v, mask), gate=gate, phase="finish")
        return cache

    def cached_velocity(self, cache, p_pad, x_t, t, state) -> torch.Tensor:
        s_emb, s_pad, s_starts, cond = self.embed_suffix(x_t, t, state)
        b, m = s_pad.shape
        n = p_pad.shape[1]
        to_prefix = p_pad[:, None, :].expand(b, m, n)
        mask = torch.cat([to_prefix, block_mask(s_pad, s_starts)], dim=2)
        positions = p_pad.sum(dim=1, keepdim=True) + torch.cumsum(s_pad.to(torch.int64), dim=1) - 1
        h = s_emb.to(cache[0][0].dtype)
        mask = attention_bias(mask, h.dtype)
        for layer, (kp, vp) in zip(self.expert.layers, cache):
            q, k, v, gate = layer(h, positions, self.expert.inv_freq, cond=cond, phase="inputs")
            attn = masked_attention(q, torch.cat([kp, k], 2), torch.cat([vp, v], 2), mask)
            h = layer(h, cond=cond, attn=attn, gate=gate, phase="finish")
        out = self.expert.final_norm(h, cond)[0]
        return self.action_out_proj(out[:, -self.cfg.chunk_size :].to(self.action_out_proj.weight.dtype))

    def blocks(self) -> list[nn.Module]:
        """Units of FSDP sharding, recompute and compile: the vision layers and each decoder's
        layers (the joint pass calls each layer's halves through the module, so their hooks run)."""
        return self.vision.blocks() + self.backbone.blocks() + self.expert.blocks()
