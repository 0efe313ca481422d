"""pi0 / pi0.5 policy mechanics on tiny configs: the block mask, the cached sampler against the
uncached one, masked cameras and padded tokens having no effect, and a falling training loss."""

import dataclasses

import pytest
import torch
from loongforge.core.errors import UserError
from loongforge.core.foundation.gemma import GemmaConfig, attention_bias, masked_attention
from loongforge.core.foundation.siglip import SiglipVisionConfig
from loongforge.embodied.policies import Observation, PiConfig, PiPolicy, block_mask, time_embedding


def tiny(variant: str) -> PiConfig:
    shared = dict(num_layers=2, num_attention_heads=2, num_query_groups=1, head_dim=8)
    return PiConfig(
        variant=variant,
        vision=SiglipVisionConfig(num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, image_size=28, patch_size=14),
        backbone=GemmaConfig(**shared, hidden_size=32, ffn_hidden_size=64, vocab_size=50),
        expert=GemmaConfig(**shared, hidden_size=16, ffn_hidden_size=32, vocab_size=50, adarms_cond_dim=16 if variant == "pi05" else None),
        chunk_size=4,
        max_action_dim=6,
        max_state_dim=5,
        num_inference_steps=3,
    )


def randomized(policy: PiPolicy) -> PiPolicy:
    """Fresh adaptive norms are gated shut (zero init); random weights make every path count."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    return policy.eval()


def observation(b: int = 2, cams: int = 2, length: int = 5, seed: int = 0) -> Observation:
    g = torch.Generator().manual_seed(seed)
    masks = torch.ones(b, length, dtype=torch.bool)
    masks[0, -2:] = False  # sample 0's prompt is shorter
    image_masks = torch.ones(b, cams, dtype=torch.bool)
    image_masks[1, 1] = False  # sample 1 lacks its second camera
    return Observation(
        images=torch.rand(b, cams, 3, 28, 28, generator=g) * 2 - 1,
        image_masks=image_masks,
        tokens=torch.randint(0, 50, (b, length), generator=g),
        token_masks=masks,
        state=torch.randn(b, 5, generator=g),
    )


def test_block_mask_is_the_papers():
    pad = torch.tensor([[True, True, False, True, True, True]])
    starts = torch.tensor([[0, 0, 0, 1, 1, 0]])  # prefix of 3 (one padded), a state block, a 2-action block
    want = torch.tensor(
        [
            [1, 1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [0, 0, 0, 0, 0, 0],
            [1, 1, 0, 1, 0, 0],
            [1, 1, 0, 1, 1, 1],
            [1, 1, 0, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(block_mask(pad, starts)[0], want)


def test_time_embedding_matches_its_formula():
    t = torch.tensor([0.0, 0.25, 1.0])
    emb = time_embedding(t, 8, 4e-3, 4.0)
    period = 4e-3 * (4.0 / 4e-3) ** (torch.arange(4, dtype=torch.float64) / 3)
    angle = 2 * torch.pi / period * t[:, None].double()
    assert torch.allclose(emb.double(), torch.cat([angle.sin(), angle.cos()], 1), atol=1e-7)


@pytest.mark.parametrize("variant", ["pi05", "pi0"])
def test_cached_sampling_equals_full_recompute(variant):
    policy = randomized(PiPolicy(tiny(variant)))
    obs = observation()
    noise = torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(3))
    got = policy.sample_actions(obs, noise=noise)
    x_t, dt = noise, -1.0 / 3
    with torch.no_grad():
        for step in range(3):
            t = torch.full((2,), 1.0 + step * dt)
            x_t = x_t + dt * policy.predict_velocity(obs, x_t, t)
    assert got.shape == (2, 4, 6)
    assert float((got - x_t).abs().max() / x_t.abs().max()) < 1e-5
    # negative control: another step count integrates to different actions
    assert float((policy.sample_actions(obs, noise=noise, num_steps=2) - x_t).abs().max()) > 1e-3


def one_joint_attention(policy, prefix, suffix, mask, positions, cond):
    """The papers' formulation of `PiPolicy.joint`: each layer's queries, keys and values of
    [prefix | suffix] concatenated into one attention under the whole block mask."""
    n = prefix.shape[1]
    bias = attention_bias(mask, prefix.dtype)
    layers = list(zip(policy.backbone.layers, policy.expert.layers))
    for idx, (lp, ls) in enumerate(layers):
        qp, kp, vp, gp = lp(prefix, positions[:, :n], policy.backbone.inv_freq, phase="inputs")
        qs, ks, vs, gs = ls(suffix, positions[:, n:], policy.expert.inv_freq, cond=cond, phase="inputs")
        out = masked_attention(torch.cat([qp, qs], 2), torch.cat([kp, ks], 2), torch.cat([vp, vs], 2), bias)
        if idx < len(layers) - 1:
            prefix = lp(prefix, attn=out[:, :, :n], gate=gp, phase="finish")
        suffix = ls(suffix, cond=cond, attn=out[:, :, n:], gate=gs, phase="finish")
    return policy.expert.final_norm(suffix, cond)[0]


@pytest.mark.parametrize("variant", ["pi05", "pi0"])
def test_joint_pass_equals_one_attention_over_prefix_and_suffix(variant):
    """`joint` runs the prefix's rows as their own attention; the loss and every gradient equal
    one attention over the concatenation (padded tokens and a missing camera included)."""
    policy = randomized(PiPolicy(tiny(variant))).train()
    obs, actions = observation(), torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(4))
    fixed = dict(noise=torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(5)), t=torch.tensor([0.3, 0.8]))

    def loss_and_grads():
        policy.zero_grad()
        loss = policy.flow_matching_loss(obs, actions, **fixed)
        loss.mean().backward()
        return loss.detach(), {k: p.grad.clone() for k, p in policy.named_parameters() if p.grad is not None}

    got, got_grads = loss_and_grads()
    policy.joint = lambda *args: one_joint_attention(policy, *args)
    want, want_grads = loss_and_grads()
    assert float((got - want).abs().max() / want.abs().max()) < 1e-6
    assert got_grads.keys() == want_grads.keys() and len(got_grads) > 20
    for k, g in want_grads.items():
        assert float((got_grads[k] - g).abs().max()) <= 1e-5 * float(g.abs().max()) + 1e-12, k


@pytest.mark.parametrize("variant", ["pi05", "pi0"])
def test_masked_camera_and_padded_tokens_do_not_count(variant):
    policy = randomized(PiPolicy(tiny(variant)))
    obs = observation()
    x_t, t = torch.randn(2, 4, 6), torch.tensor([0.3, 0.8])
    with torch.no_grad():
        base = policy.predict_velocity(obs, x_t, t)
        changed = dataclasses.replace(obs, images=obs.images.clone(), tokens=obs.tokens.clone())
        changed.images[1, 1] = torch.rand(3, 28, 28)  # the missing camera's pixels
        changed.tokens[0, -2:] = (changed.tokens[0, -2:] + 7) % 50  # sample 0's padding
        assert torch.allclose(policy.predict_velocity(changed, x_t, t), base, atol=1e-6)
        # negative control: a visible camera's pixels do change the prediction
        changed.images[0, 0] = torch.rand(3, 28, 28)
        assert not torch.allclose(policy.predict_velocity(changed, x_t, t)[0], base[0], atol=1e-4)


@pytest.mark.parametrize("variant", ["pi05", "pi0"])
def test_loss_falls_when_fitting_one_batch(variant):
    torch.manual_seed(0)
    policy = PiPolicy(tiny(variant))
    obs, actions = observation(), torch.randn(2, 4, 6)
    opt = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    fixed = dict(noise=torch.randn(2, 4, 6, generator=g), t=torch.tensor([0.4, 0.7]))
    first = float(policy.flow_matching_loss(obs, actions, **fixed).mean())
    for _ in range(40):  # the same noise and times every step: a pure fit of one target
        loss = policy.flow_matching_loss(obs, actions, **fixed).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    last = float(policy.flow_matching_loss(obs, actions, **fixed).mean())
    assert last < 0.2 * first, (first, last)


def test_time_sampling_follows_the_shifted_beta():
    policy = PiPolicy(tiny("pi05"))
    t = policy.sample_time(20000, "cpu", torch.Generator().manual_seed(0))
    assert float(t.min()) >= 0.001 and float(t.max()) <= 1.0
    # Beta(1.5, 1) has mean 0.6: scaled by 0.999 and shifted by 0.001
    assert abs(float(t.mean()) - (0.6 * 0.999 + 0.001)) < 0.01


def test_config_errors():
    cfg = tiny("pi05")
    with pytest.raises(UserError, match="expert.num_layers=3 must equal policy.backbone.num_layers=2"):
        PiPolicy(dataclasses.replace(cfg, expert=dataclasses.replace(cfg.expert, num_layers=3)))
    # pi0.5's expert norms default to conditioning on a vector as wide as the expert; pi0 has none
    assert PiPolicy(dataclasses.replace(cfg, expert=dataclasses.replace(cfg.expert, adarms_cond_dim=None))).cfg.expert.adarms_cond_dim == 16
    assert PiPolicy(PiConfig(variant="pi05")).cfg.expert.adarms_cond_dim == PiConfig().expert.hidden_size
    with pytest.raises(UserError, match="adaptive norms must be off"):
        PiPolicy(dataclasses.replace(tiny("pi0"), expert=dataclasses.replace(tiny("pi0").expert, adarms_cond_dim=16)))
    with pytest.raises(UserError, match="variant='pi1'"):
        PiPolicy(dataclasses.replace(cfg, variant="pi1"))
    pi0 = PiPolicy(tiny("pi0"))
    with pytest.raises(UserError, match="needs observation.state"):
        pi0.predict_velocity(dataclasses.replace(observation(), state=None), torch.zeros(2, 4, 6), torch.ones(2))


@pytest.mark.parametrize("variant", ["pi05", "pi0"])
def test_lerobot_layout_round_trip_and_errors(variant):
    from loongforge.embodied.policies.lerobot_format import EXPERT_LM_HEAD, from_lerobot, to_lerobot

    cfg = tiny(variant)
    policy = randomized(PiPolicy(cfg))
    state = policy.state_dict()
    exported = to_lerobot(cfg, state)
    assert "model.paligemma_with_expert.paligemma.model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight" in exported
    assert exported[EXPERT_LM_HEAD].shape == (cfg.expert.vocab_size, cfg.expert.hidden_size)
    back = from_lerobot(cfg, {k.removeprefix("model."): v for k, v in exported.items()})  # openpi's files lack "model."
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    with pytest.raises(UserError, match=r"LeRobot .* weights: .*has tensor 'model.extra.weight'"):
        from_lerobot(cfg, {**exported, "model.extra.weight": torch.zeros(1)})
    del exported["model.action_in_proj.weight"]
    with pytest.raises(UserError, match="lacks tensor 'model.action_in_proj.weight'"):
        from_lerobot(cfg, exported)
