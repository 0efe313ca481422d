"""LoongForge's pi0 / pi0.5 policy against LeRobot's (lerobot 0.4.4) with the same weights.

LeRobot's `PI05Policy` needs openpi's patched transformers 4.53.2 (adaptive RMSNorm in Gemma,
unscaled PaliGemma image features, a cache that is read but not grown during denoising), which
is not installable. `patch_transformers` supplies those changes here, in this harness only, as
the pi0.5 paper and openpi define them; LeRobot's own model code, masks, embeddings and
flow-matching loss then run unchanged and are the oracle.

Checks, fp32 on the CPU (or `--device cuda`):
1. the per-element flow-matching loss on one batch (same noise, same times);
2. the sampled action chunk from the same noise (10 Euler steps, prefix KV cache on both sides);
3. LeRobot weights -> LoongForge -> LeRobot: every tensor the policy reads comes back bit-identical.

The shapes are tiny except where LeRobot fixes them (vocabulary 257152, PaliGemma projection
width 2048, SigLIP MLP width 4304, 8 attention heads), so the backbone is 2048 wide.

Setup (a separate directory, so the project's own transformers stays as it is):
    python -m pip download --no-deps -d wheels lerobot==0.4.4 transformers==4.53.2 \\
        huggingface_hub==0.35.3 tokenizers==0.21.4 draccus==0.10.0 mergedeep typing-inspect \\
        mypy-extensions toml pyyaml-include==1.4.1 requests urllib3 idna charset_normalizer certifi
    python -m pip install --no-deps --target /tmp/site_lr wheels/*.whl
    python tools/oracles/pi_vs_lerobot.py --site /tmp/site_lr [--variant pi05|pi0]
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import sys
import types

# lerobot imports these at module level on paths the policy never runs (datasets, robots, video):
# the first two always get placeholders (the installed `datasets` may need a newer
# huggingface_hub than transformers 4.53.2 takes), the others only where they are not installed
ALWAYS_STUBBED = ("datasets", "diffusers")
STUBBED_IF_MISSING = (
    "torchvision",
    "imageio",
    "serial",
    "deepdiff",
    "einops",
    "av",
    "torchcodec",
    "cv2",
    "pynput",
    "jsonlines",
    "rerun",
    "gymnasium",
    "termcolor",
    "wandb",
)


class _AnyMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _named(name)


class _Anything(metaclass=_AnyMeta):
    """Stands for any attribute of a placeholder module, at any depth (`av.logging.WARNING`), as
    a value, a base class or a callable."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return self

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _named(name)


_NAMED: dict[str, type] = {}


def _named(name: str) -> type:
    """One distinct `_Anything` subclass per name, so two of them can be bases of one class."""
    return _NAMED.setdefault(name, _AnyMeta(name, (_Anything,), {}))


class _Placeholder(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _named(name)


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Placeholder modules (installed ones of STUBBED_IF_MISSING import as they are:
    transformers reads torchvision's real API when it finds it)."""

    def __init__(self):
        import importlib.util

        self.missing = set(ALWAYS_STUBBED) | {m for m in STUBBED_IF_MISSING if importlib.util.find_spec(m) is None}

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.missing:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Placeholder(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def patch_transformers() -> None:
    """adaRMS Gemma and openpi's PaliGemma / SigLIP / cache behaviour on transformers 4.53.2."""
    import torch
    import transformers
    from torch import nn
    from transformers.cache_utils import DynamicCache
    from transformers.modeling_outputs import BaseModelOutputWithPast
    from transformers.models.gemma import modeling_gemma as g
    from transformers.models.paligemma import modeling_paligemma as pg

    if transformers.__version__ != "4.53.2":
        sys.exit(f"needs transformers 4.53.2 first on the path (found {transformers.__version__}); see --help")

    class AdaptiveGemmaRMSNorm(nn.Module):
        def __init__(self, dim, eps=1e-6, cond_dim=None):
            super().__init__()
            self.eps, self.cond_dim = eps, cond_dim
            if cond_dim:
                self.dense = nn.Linear(cond_dim, 3 * dim)
                nn.init.zeros_(self.dense.weight)
            else:
                self.weight = nn.Parameter(torch.zeros(dim))
                self.dense = None

        def forward(self, x, cond=None):
            var = x.float().pow(2).mean(-1, keepdim=True)
            normed = x * torch.rsqrt(var + self.eps)
            if cond is None or self.dense is None:
                return (normed * (1.0 + self.weight.float())).to(x.dtype), None
            mod = self.dense(cond)
            if x.dim() == 3:
                mod = mod.unsqueeze(1)
            scale, shift, gate = mod.chunk(3, dim=-1)
            return (normed * (1 + scale.float()) + shift.float()).to(x.dtype), gate.to(x.dtype)

    def cond_dim(config):
        return getattr(config, "adarms_cond_dim", None) if getattr(config, "use_adarms", False) else None

    def gated_residual(x, y, gate):
        return x + y if gate is None else x + y * gate

    layer_init = g.GemmaDecoderLayer.__init__

    def decoder_layer_init(self, config, layer_idx):
        layer_init(self, config, layer_idx)
        self.input_layernorm = AdaptiveGemmaRMSNorm(config.hidden_size, config.rms_norm_eps, cond_dim(config))
        self.post_attention_layernorm = AdaptiveGemmaRMSNorm(config.hidden_size, config.rms_norm_eps, cond_dim(config))

    def decoder_layer_forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None, use_cache=False,
                              cache_position=None, position_embeddings=None, adarms_cond=None, **kwargs):  # fmt: skip
        residual = hidden_states
        hidden_states, gate = self.input_layernorm(hidden_states, adarms_cond)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_value=past_key_value,
            use_cache=use_cache,
            cache_position=cache_position,
            position_embeddings=position_embeddings,
        )
        hidden_states = gated_residual(residual, hidden_states, gate)
        residual = hidden_states
        hidden_states, gate = self.post_attention_layernorm(hidden_states, adarms_cond)
        return (gated_residual(residual, self.mlp(hidden_states), gate),)

    def attention_forward(self, hidden_states, position_embeddings, attention_mask, past_key_value=None, cache_position=None,
                          use_cache=False, **kwargs):  # fmt: skip
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = g.apply_rotary_pos_emb(q, k, cos, sin)
        if past_key_value is not None:
            if use_cache:  # the prefix pass fills the cache
                k, v = past_key_value.update(k, v, self.layer_idx, {"sin": sin, "cos": cos, "cache_position": cache_position})
            else:  # each denoising step reads it without growing it
                k = torch.cat([past_key_value[self.layer_idx][0], k], dim=2)
                v = torch.cat([past_key_value[self.layer_idx][1], v], dim=2)
        out, weights = g.eager_attention_forward(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling)
        return self.o_proj(out.reshape(*shape[:-2], -1).contiguous()), weights

    model_init = g.GemmaModel.__init__

    def model_init_patched(self, config):
        model_init(self, config)
        self.norm = AdaptiveGemmaRMSNorm(config.hidden_size, config.rms_norm_eps, cond_dim(config))

    def model_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None,
                      use_cache=None, adarms_cond=None, **kwargs):  # fmt: skip
        # openpi's GemmaModel: the caller scales the embeddings and passes the 4-d mask
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if len(self.layers):  # openpi: embeddings into the layers' dtype
            hidden = hidden.to(self.layers[0].self_attn.q_proj.weight.dtype)
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        seen = past_key_values.get_seq_length() if past_key_values is not None else 0
        cache_position = torch.arange(seen, seen + hidden.shape[1], device=hidden.device)
        if position_ids is None:
            position_ids = cache_position.unsqueeze(0)
        position_embeddings = self.rotary_emb(hidden, position_ids)
        for layer in self.layers[: self.config.num_hidden_layers]:
            hidden = layer(
                hidden,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_value=past_key_values,
                use_cache=use_cache,
                cache_position=cache_position,
                position_embeddings=position_embeddings,
                adarms_cond=adarms_cond,
            )[0]
        hidden, _ = self.norm(hidden, adarms_cond)
        return BaseModelOutputWithPast(last_hidden_state=hidden, past_key_values=past_key_values if use_cache else None)

    from transformers.models.siglip import modeling_siglip as sg

    encoder_forward = sg.SiglipEncoder.forward

    def encoder_forward_patched(self, inputs_embeds, *a, **kw):  # openpi: fp32 embeddings into bf16 layers
        if len(self.layers):
            inputs_embeds = inputs_embeds.to(self.layers[0].self_attn.q_proj.weight.dtype)
        return encoder_forward(self, inputs_embeds, *a, **kw)

    def image_features(self, pixel_values):  # openpi: no 1/sqrt(width) scale on the image tokens
        return self.multi_modal_projector(self.vision_tower(pixel_values).last_hidden_state)

    init_weights = g.GemmaPreTrainedModel._init_weights

    def init_weights_patched(self, module):
        if isinstance(module, AdaptiveGemmaRMSNorm) and module.dense is not None:
            return  # zero-initialized in its constructor, as openpi's
        init_weights(self, module)

    g.GemmaRMSNorm = AdaptiveGemmaRMSNorm
    g.GemmaPreTrainedModel._init_weights = init_weights_patched
    g._gated_residual = gated_residual
    g.GemmaDecoderLayer.__init__ = decoder_layer_init
    g.GemmaDecoderLayer.forward = decoder_layer_forward
    g.GemmaAttention.forward = attention_forward
    g.GemmaModel.__init__ = model_init_patched
    g.GemmaModel.forward = model_forward
    pg.PaliGemmaModel.get_image_features = image_features
    sg.SiglipEncoder.forward = encoder_forward_patched
    check = types.ModuleType("transformers.models.siglip.check")
    check.check_whether_transformers_replace_is_installed_correctly = lambda: True
    sys.modules[check.__name__] = check


def tiny_shapes(modeling, vision_layers: int, vision_width: int):
    """Small Gemma variants under LeRobot's names, and a small SigLIP inside its PaliGemma config."""
    import transformers

    sizes = {
        "gemma_2b": dict(width=2048, depth=2, mlp_dim=64, num_heads=8, num_kv_heads=1, head_dim=16),
        "gemma_300m": dict(width=64, depth=2, mlp_dim=96, num_heads=8, num_kv_heads=1, head_dim=16),
    }
    modeling.get_gemma_config = lambda variant: modeling.GemmaConfig(**sizes[variant])

    class Configs(dict):
        def __getitem__(self, name):
            if name == "paligemma":
                vision = dict(
                    num_hidden_layers=vision_layers, hidden_size=vision_width, num_attention_heads=2, patch_size=14, vision_use_head=False
                )
                return lambda: transformers.PaliGemmaConfig(vision_config=vision)
            return transformers.models.auto.CONFIG_MAPPING[name]

    modeling.CONFIG_MAPPING = Configs()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--site", required=True, help="directory holding lerobot 0.4.4 and transformers 4.53.2 (pip --target)")
    ap.add_argument("--variant", choices=("pi05", "pi0"), default="pi05")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--image-size", type=int, default=56)
    ap.add_argument("--tolerance", type=float, default=1e-5)
    args = ap.parse_args()
    sys.path.insert(0, args.site)
    sys.meta_path.insert(0, _StubFinder())
    patch_transformers()

    import torch
    from lerobot.configs.types import FeatureType, PolicyFeature

    if args.variant == "pi05":
        from lerobot.policies.pi05 import modeling_pi05 as modeling
        from lerobot.policies.pi05.configuration_pi05 import PI05Config as LRConfig
    else:
        from lerobot.policies.pi0 import modeling_pi0 as modeling
        from lerobot.policies.pi0.configuration_pi0 import PI0Config as LRConfig
    from loongforge.core.foundation.gemma import GemmaConfig
    from loongforge.core.foundation.siglip import SiglipVisionConfig
    from loongforge.embodied.policies import Observation, PiConfig, PiPolicy
    from loongforge.embodied.policies.lerobot_format import EXPERT_LM_HEAD, from_lerobot, to_lerobot

    vision_layers, vision_width, size = 2, 32, args.image_size
    tiny_shapes(modeling, vision_layers, vision_width)
    torch.manual_seed(0)
    cams, chunk, state_dim, action_dim = 2, 8, 7, 6
    features = {f"observation.images.cam{c}": PolicyFeature(FeatureType.VISUAL, (3, size, size)) for c in range(cams)}
    features["observation.state"] = PolicyFeature(FeatureType.STATE, (state_dim,))
    lr_cfg = LRConfig(
        input_features=features,
        output_features={"action": PolicyFeature(FeatureType.ACTION, (action_dim,))},
        device=args.device,
        dtype="float32",
        chunk_size=chunk,
        n_action_steps=chunk,
        image_resolution=(size, size),
    )
    lr_policy = modeling.PI05Policy(lr_cfg) if args.variant == "pi05" else modeling.PI0Policy(lr_cfg)
    lr_policy.eval()
    with torch.no_grad():  # LeRobot's norms start at zero and the adaptive ones gated shut: make every path count
        for name, p in lr_policy.named_parameters():
            if "norm" in name or "dense" in name:
                p.normal_(0.0, 0.2)
    lr_state = {k: v.detach().clone() for k, v in lr_policy.state_dict().items()}

    shared = dict(num_layers=2, num_attention_heads=8, num_query_groups=1, head_dim=16, vocab_size=257152)
    cfg = PiConfig(
        variant=args.variant,
        vision=SiglipVisionConfig(
            num_layers=vision_layers, hidden_size=vision_width, num_attention_heads=2, ffn_hidden_size=4304, image_size=size, patch_size=14
        ),
        backbone=GemmaConfig(**shared, hidden_size=2048, ffn_hidden_size=64),
        expert=GemmaConfig(**shared, hidden_size=64, ffn_hidden_size=96, adarms_cond_dim=64 if args.variant == "pi05" else None),
        chunk_size=chunk,
        max_action_dim=lr_cfg.max_action_dim,
        max_state_dim=lr_cfg.max_state_dim,
        num_inference_steps=lr_cfg.num_inference_steps,
    )
    ours = PiPolicy(cfg).to(args.device).eval()
    ours.load_state_dict(from_lerobot(cfg, lr_state), strict=True)

    b, length, dev = 2, 12, args.device
    g = torch.Generator().manual_seed(1)
    images = torch.rand(b, cams, 3, size, size, generator=g) * 2 - 1
    image_masks = torch.tensor([[True, True], [True, False]])
    tokens = torch.randint(0, 257152, (b, length), generator=g)
    token_masks = torch.ones(b, length, dtype=torch.bool)
    token_masks[0, -3:] = False
    state = torch.randn(b, lr_cfg.max_state_dim, generator=g)
    actions = torch.randn(b, chunk, lr_cfg.max_action_dim, generator=g)
    noise = torch.randn(b, chunk, lr_cfg.max_action_dim, generator=g)
    t = torch.tensor([0.3, 0.85])
    images, image_masks, tokens, token_masks, state, actions, noise, t = (
        x.to(dev) for x in (images, image_masks, tokens, token_masks, state, actions, noise, t)
    )
    lr_images, lr_masks = list(images.unbind(1)), list(image_masks.unbind(1))
    obs = Observation(images, image_masks, tokens, token_masks, state if args.variant == "pi0" else None)
    with torch.no_grad():
        extra = () if args.variant == "pi05" else (state,)
        want_loss = lr_policy.model.forward(lr_images, lr_masks, tokens, token_masks, *extra, actions, noise=noise, time=t)
        got_loss = ours.flow_matching_loss(obs, actions, noise=noise, t=t)
        want_actions = lr_policy.model.sample_actions(lr_images, lr_masks, tokens, token_masks, *extra, noise=noise)
        got_actions = ours.sample_actions(obs, noise=noise)

    def rel(a, b):
        return float((a.float() - b.float()).abs().max() / b.float().abs().max())

    back = to_lerobot(cfg, ours.state_dict())
    compared = [k for k in lr_state if k != EXPERT_LM_HEAD]
    identical = sum(torch.equal(back[k].cpu(), lr_state[k].cpu()) for k in compared)
    missing = sorted(set(lr_state) - set(back))
    rows = [
        ("flow-matching loss, per element", rel(got_loss, want_loss), float(want_loss.mean())),
        (f"sampled actions ({cfg.num_inference_steps} Euler steps)", rel(got_actions, want_actions), float(want_actions.abs().mean())),
    ]
    print(f"\nLoongForge {args.variant} vs LeRobot 0.4.4 (transformers 4.53.2 + adaRMS patch), fp32, {dev}")
    print(f"{'check':42s} {'max rel err':>12s} {'reference scale':>16s}")
    for name, err, scale in rows:
        print(f"{name:42s} {err:12.2e} {scale:16.4f}")
    print(f"{'weights LeRobot -> LF -> LeRobot':42s} {identical}/{len(compared)} bit-identical, missing {missing}")
    ok = all(err < args.tolerance for _, err, _ in rows) and identical == len(compared) and not missing
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
