"""Wan2.1 / Wan2.2 video diffusion transformer (text-to-video) on core's op table, with its
diffusers mapping table.

The math of diffusers' `WanTransformer3DModel`: a 3-D patch embedding; per layer adaLN-style
modulation from the time embedding (shift / scale / gate from a learned table plus the projected
time), self-attention with q/k RMSNorm across heads and 3-D RoPE (time, height, width channel
groups, adjacent channel pairs), cross-attention to the text states, a GELU-tanh MLP; a modulated
output norm and projection, unpatchified.

Samples of different sizes run packed: every sample's patch tokens are concatenated into one
[tokens, hidden] row and attention never crosses a sample (op `packed_attention`), each token
rotated by its own sample's (t, h, w) position and modulated by its own sample's time. Nothing is
padded to the largest sample. `forward` also takes diffusers' own arguments (a batch of equal-size
latents), so the module is a drop-in for the diffusers model.

q/k/v of self-attention are one fused linear and k/v of cross-attention another (one GEMM
each); `WAN_TABLE` maps them to diffusers' separate tensors.

With a `tp_group` (tensor parallelism, the megatron stack) each rank keeps its share of the
heads of both attentions and of the MLP's hidden units (`core.parallel.tensor_parallel`): the
q/k RMSNorms across heads sum their squares over the group, the output projections sum their
partial products; the embeddings, modulation and output projection stay whole on every rank.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.nn.functional as F
from loongforge.core.errors import UserError
from loongforge.core.foundation.hf_mapping import Row
from loongforge.core.ops import OpTable
from loongforge.core.parallel import tensor_parallel as tp
from loongforge.core.parallel.ulysses import heads_to_seq, local_range, padded_range, seq_to_heads
from torch import nn


@dataclass
class WanConfig:
    """The transformer's shape under diffusers' own config names (`WanTransformer3DModel`)."""

    patch_size: List[int] = field(default_factory=lambda: [1, 2, 2])
    num_attention_heads: int = 2
    attention_head_dim: int = 12
    in_channels: int = 4
    out_channels: int = 4
    text_dim: int = 32
    freq_dim: int = 32
    ffn_dim: int = 48
    num_layers: int = 2
    cross_attn_norm: bool = True
    qk_norm: str = "rms_norm_across_heads"
    eps: float = 1e-6
    rope_max_seq_len: int = 1024
    # image-to-video (Wan2.1 I2V): the width of the CLIP image features each cross-attention also
    # attends to, through its own k / v projections (added_kv_proj_dim: the hidden size); None: T2V
    image_dim: Optional[int] = None
    added_kv_proj_dim: Optional[int] = None

    @property
    def hidden_size(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def patch_volume(self) -> int:
        return math.prod(self.patch_size)

    def rope_dims(self) -> tuple[int, int, int]:
        """Channels of each head given to time, height and width (diffusers' split)."""
        h = w = 2 * (self.attention_head_dim // 6)
        return self.attention_head_dim - h - w, h, w

    def repeats(self) -> dict[str, int]:
        return {"i": self.num_layers}

    def train_flops(self, tokens: int, text_len: int) -> float:
        """Matmul FLOPs of one sample's forward + backward (3x forward): the layers' projections,
        MLP and both attentions, the patch / text embeddings and the output projection."""
        d, f, n = self.hidden_size, self.ffn_dim, self.num_layers
        per_layer = 2 * (6 * d * d + 2 * d * f) * tokens + 2 * 2 * d * d * text_len + 4 * tokens * tokens * d + 4 * tokens * text_len * d
        io = 2 * tokens * d * (self.in_channels + self.out_channels) * self.patch_volume + 2 * text_len * (self.text_dim * d + d * d)
        return 3.0 * (n * per_layer + io)

    def check(self) -> None:
        if len(self.patch_size) != 3 or any(int(p) < 1 for p in self.patch_size):
            raise UserError(f"model.patch_size={list(self.patch_size)}: three positive sizes (time, height, width)")
        if self.attention_head_dim % 2 or any(d % 2 for d in self.rope_dims()):
            raise UserError(f"model.attention_head_dim={self.attention_head_dim}: must split into even time/height/width rotary parts")
        if self.qk_norm != "rms_norm_across_heads":
            raise UserError(f"model.qk_norm={self.qk_norm!r}: only 'rms_norm_across_heads' (Wan's) is implemented")
        if (self.image_dim is None) != (self.added_kv_proj_dim is None):
            raise UserError("model.image_dim and model.added_kv_proj_dim come together (image-to-video) or not at all")
        if self.added_kv_proj_dim not in (None, self.hidden_size):
            raise UserError(f"model.added_kv_proj_dim={self.added_kv_proj_dim} must equal the hidden size {self.hidden_size} (Wan's)")

    def diffusers_config(self) -> dict:
        """The `WanTransformer3DModel` config.json fields of this shape."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["patch_size"] = list(self.patch_size)
        return {"_class_name": "WanTransformer3DModel", **d, "pos_embed_seq_len": None}

    @classmethod
    def from_diffusers(cls, d: dict) -> "WanConfig":
        """From a diffusers config.json; a field this model does not implement is refused by name."""
        refused = {"pos_embed_seq_len": "(Wan first-last-frame-to-video) is not implemented"}
        cfg = cls(**diffusers_fields(cls, d, "WanTransformer3DModel", refused))
        cfg.patch_size = list(cfg.patch_size)
        cfg.out_channels = cfg.out_channels or cfg.in_channels
        cfg.check()
        return cfg


def diffusers_fields(cls, d: dict, class_name: str, refused: dict[str, str]) -> dict:
    """The fields of dataclass `cls` in diffusers config `d`, after checking that `d` is a
    `class_name`, that no key of `refused` ({key: why}) is set (None or False), and that every
    other field is one of `cls`'s: each refusal names the field."""
    if d.get("_class_name", class_name) != class_name:
        raise UserError(f"config.json is a {d['_class_name']}, not a {class_name}")
    for key, why in refused.items():
        if d.get(key) not in (None, False):
            raise UserError(f"config.json: {key}={d[key]} {why}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(k for k in d if not k.startswith("_") and k not in known and k not in refused)
    if unknown:
        raise UserError(f"config.json: field {unknown[0]!r} of {class_name} is not implemented here")
    return {k: v for k, v in d.items() if k in known}


B = "blocks.{i}."
L = "layers.{i}."

WAN_TABLE = (
    Row("patch_embedding.weight", ("patch_embedding.weight",)),
    Row("patch_embedding.bias", ("patch_embedding.bias",)),
    Row("time_in.fc1.weight", ("condition_embedder.time_embedder.linear_1.weight",)),
    Row("time_in.fc1.bias", ("condition_embedder.time_embedder.linear_1.bias",)),
    Row("time_in.fc2.weight", ("condition_embedder.time_embedder.linear_2.weight",)),
    Row("time_in.fc2.bias", ("condition_embedder.time_embedder.linear_2.bias",)),
    Row("time_proj.weight", ("condition_embedder.time_proj.weight",)),
    Row("time_proj.bias", ("condition_embedder.time_proj.bias",)),
    Row("text_in.fc1.weight", ("condition_embedder.text_embedder.linear_1.weight",)),
    Row("text_in.fc1.bias", ("condition_embedder.text_embedder.linear_1.bias",)),
    Row("text_in.fc2.weight", ("condition_embedder.text_embedder.linear_2.weight",)),
    Row("text_in.fc2.bias", ("condition_embedder.text_embedder.linear_2.bias",)),
    Row(L + "modulation", (B + "scale_shift_table",)),
    Row(L + "self_attn.qkv.weight", tuple(B + f"attn1.to_{p}.weight" for p in "qkv"), "concat"),
    Row(L + "self_attn.qkv.bias", tuple(B + f"attn1.to_{p}.bias" for p in "qkv"), "concat"),
    Row(L + "self_attn.norm_q.weight", (B + "attn1.norm_q.weight",)),
    Row(L + "self_attn.norm_k.weight", (B + "attn1.norm_k.weight",)),
    Row(L + "self_attn.out.weight", (B + "attn1.to_out.0.weight",)),
    Row(L + "self_attn.out.bias", (B + "attn1.to_out.0.bias",)),
    Row(L + "cross_norm.weight", (B + "norm2.weight",), optional=True),
    Row(L + "cross_norm.bias", (B + "norm2.bias",), optional=True),
    Row(L + "cross_attn.q.weight", (B + "attn2.to_q.weight",)),
    Row(L + "cross_attn.q.bias", (B + "attn2.to_q.bias",)),
    Row(L + "cross_attn.kv.weight", tuple(B + f"attn2.to_{p}.weight" for p in "kv"), "concat"),
    Row(L + "cross_attn.kv.bias", tuple(B + f"attn2.to_{p}.bias" for p in "kv"), "concat"),
    Row(L + "cross_attn.norm_q.weight", (B + "attn2.norm_q.weight",)),
    Row(L + "cross_attn.norm_k.weight", (B + "attn2.norm_k.weight",)),
    Row(L + "cross_attn.image_kv.weight", (B + "attn2.add_k_proj.weight", B + "attn2.add_v_proj.weight"), "concat", optional=True),
    Row(L + "cross_attn.image_kv.bias", (B + "attn2.add_k_proj.bias", B + "attn2.add_v_proj.bias"), "concat", optional=True),
    Row(L + "cross_attn.norm_image_k.weight", (B + "attn2.norm_added_k.weight",), optional=True),
    Row(L + "cross_attn.out.weight", (B + "attn2.to_out.0.weight",)),
    Row(L + "cross_attn.out.bias", (B + "attn2.to_out.0.bias",)),
    Row(L + "fc1.weight", (B + "ffn.net.0.proj.weight",)),
    Row(L + "fc1.bias", (B + "ffn.net.0.proj.bias",)),
    Row(L + "fc2.weight", (B + "ffn.net.2.weight",)),
    Row(L + "fc2.bias", (B + "ffn.net.2.bias",)),
    Row("image_in.norm1.weight", ("condition_embedder.image_embedder.norm1.weight",), optional=True),
    Row("image_in.norm1.bias", ("condition_embedder.image_embedder.norm1.bias",), optional=True),
    Row("image_in.fc1.weight", ("condition_embedder.image_embedder.ff.net.0.proj.weight",), optional=True),
    Row("image_in.fc1.bias", ("condition_embedder.image_embedder.ff.net.0.proj.bias",), optional=True),
    Row("image_in.fc2.weight", ("condition_embedder.image_embedder.ff.net.2.weight",), optional=True),
    Row("image_in.fc2.bias", ("condition_embedder.image_embedder.ff.net.2.bias",), optional=True),
    Row("image_in.norm2.weight", ("condition_embedder.image_embedder.norm2.weight",), optional=True),
    Row("image_in.norm2.bias", ("condition_embedder.image_embedder.norm2.bias",), optional=True),
    Row("proj_out.weight", ("proj_out.weight",)),
    Row("proj_out.bias", ("proj_out.bias",)),
    Row("out_modulation", ("scale_shift_table",)),
)


@dataclass
class Pack:
    """Samples of any sizes as one row of patch tokens: `grids[i]` = sample i's (frames, height,
    width) in patches, `cu_seqlens` its token bounds. Under context parallelism (`cp_group`) this
    rank holds tokens [start, end) of the row between attentions: `sample_of_token` and
    `local_cu` (each sample's bounds within the slice) and `local_lens` (each sample's token count
    in it, host ints) describe those; otherwise the slice is the whole row. `token_times`: the
    model's times are one per token (its modulation rows already the slice's), not one per sample."""

    grids: list[tuple[int, int, int]]
    cu_seqlens: torch.Tensor
    sample_of_token: torch.Tensor
    local_cu: torch.Tensor
    local_lens: list[int]
    start: int = 0
    end: int = 0
    cp_group: object = None
    token_times: bool = False

    @classmethod
    def of(cls, grids: list[tuple[int, int, int]], device, start: int = 0, end: int | None = None, cp_group=None) -> "Pack":
        sizes = [f * h * w for f, h, w in grids]
        lens = torch.tensor(sizes, device=device)
        cu = F.pad(lens.cumsum(0), (1, 0)).to(torch.int32)
        end = sum(sizes) if end is None else end
        owner = torch.repeat_interleave(torch.arange(len(grids), device=device), lens)
        return cls(list(grids), cu, owner[start:end], (cu - start).clamp(0, end - start), lens_in(sizes, start, end), start, end, cp_group)

    @property
    def max_len(self) -> int:
        return max(f * h * w for f, h, w in self.grids)

    @property
    def total(self) -> int:
        return sum(f * h * w for f, h, w in self.grids)


def lens_in(sizes: list[int], start: int, end: int) -> list[int]:
    """How many tokens of each run of `sizes` (consecutive in one row) lie in [start, end)."""
    firsts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [max(0, min(a + n, end) - max(a, start)) for a, n in zip(firsts, sizes)]


def timestep_features(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal features of diffusion times [n] -> [n, dim] (cos first, diffusers' Timesteps
    with flip_sin_to_cos=True, downscale_freq_shift=0)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, pack: Pack) -> torch.Tensor:
    """x * (1 + scale) + shift with per-sample (or per-token) shift / scale, broadcast to tokens."""
    return x * (1 + _per_token(scale, pack)) + _per_token(shift, pack)


def _per_token(v: torch.Tensor, pack: Pack) -> torch.Tensor:
    """[samples, hidden] (or already [tokens, hidden]) -> a tensor broadcasting against [tokens, hidden]."""
    if pack.token_times or v.shape[0] == 1:
        return v
    return sample_rows(v, pack.sample_of_token, pack.local_lens)


def sample_rows(v: torch.Tensor, owner: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """v [samples, ...] -> [tokens, ...]: token t takes row owner[t]; the samples' tokens are
    contiguous runs of `lens` (host ints, summing to the tokens)."""
    return _SampleRows.apply(v, owner, lens)


class _SampleRows(torch.autograd.Function):
    """v [samples, ...] -> [tokens, ...], token t taking its sample's row (`owner`, samples in
    contiguous runs of `lens` tokens, host ints). The backward sums each run of the gradient: the
    gradient of an index (index_put with accumulation) adds tens of thousands of rows into the
    same few on CUDA, which serializes over the repeats."""

    @staticmethod
    def forward(ctx, v, owner, lens):
        ctx.lens = lens
        return v.index_select(0, owner)

    @staticmethod
    def backward(ctx, grad):
        return torch.stack([part.sum(0) for part in grad.split(ctx.lens)]), None, None


class MLP2(nn.Module):
    """Linear, activation, linear (the time and text embedders)."""

    def __init__(self, d_in: int, d_out: int, act):
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(d_in, d_out), nn.Linear(d_out, d_out), act

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class HeadNorms:
    """What Wan's attentions share: q/k RMSNorm across all heads, on one rank or on a TP rank's
    share of the heads (`tp_group`), and the heads this rank holds."""

    def _setup(self, cfg: WanConfig, ops: OpTable) -> None:
        self.heads, self.eps, self.ops, self.width, self.tp_group = cfg.num_attention_heads, cfg.eps, ops, cfg.hidden_size, None

    def head_norm(self, x: torch.Tensor, norm: "RMSWeight") -> torch.Tensor:
        if self.tp_group is None:
            return self.ops.rms_norm(x, norm.weight, self.eps)
        return tp.rms_norm(x, norm.weight, self.eps, self.tp_group, self.width)

    def _shard_heads(self, group, norms: list["RMSWeight"]) -> None:
        """Keep this TP rank's share of the heads: of the norms' weights, and in `heads`."""
        for norm in norms:
            norm.weight = tp.shard_param(norm.weight, group, 0)
        self.heads //= torch.distributed.get_world_size(group)
        self.tp_group = group


class SelfAttention(nn.Module, HeadNorms):
    def __init__(self, cfg: WanConfig, ops: OpTable):
        super().__init__()
        d = cfg.hidden_size
        self._setup(cfg, ops)
        self.qkv = nn.Linear(d, 3 * d)
        self.norm_q, self.norm_k = RMSWeight(d), RMSWeight(d)
        self.out = nn.Linear(d, d)

    def shard(self, group) -> None:
        """Keep this TP rank's share of the heads."""
        tp.shard_linear(self.qkv, group, 0, chunks=3)
        tp.shard_linear(self.out, group, 1)
        self._shard_heads(group, [self.norm_q, self.norm_k])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pack: Pack) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(tp.column_input(x, self.tp_group)).chunk(3, dim=-1)
        q = self.head_norm(q, self.norm_q).view(t, self.heads, -1)
        k = self.head_norm(k, self.norm_k).view(t, self.heads, -1)
        q, k = self.ops.rotary(q, k, cos, sin, True)
        v = v.reshape(t, self.heads, -1)
        if pack.cp_group is not None:  # every token of the row, for this rank's share of the heads
            q, k, v = (seq_to_heads(u, pack.cp_group) for u in (q, k, v))
        o = self.ops.packed_attention(q, k, v, pack.cu_seqlens, pack.cu_seqlens, None, pack.max_len, pack.max_len)
        if pack.cp_group is not None:
            o = heads_to_seq(o, pack.cp_group)
        return tp.row_linear(self.out, o.reshape(t, -1), self.tp_group)


class CrossAttention(nn.Module, HeadNorms):
    def __init__(self, cfg: WanConfig, ops: OpTable):
        super().__init__()
        d = cfg.hidden_size
        self._setup(cfg, ops)
        self.q, self.kv = nn.Linear(d, d), nn.Linear(d, 2 * d)
        self.norm_q, self.norm_k = RMSWeight(d), RMSWeight(d)
        self.image_kv = None
        if cfg.image_dim is not None:  # image-to-video: the image features' own k / v
            self.image_kv, self.norm_image_k = nn.Linear(d, 2 * d), RMSWeight(d)
        self.out = nn.Linear(d, d)

    def shard(self, group) -> None:
        """Keep this TP rank's share of the heads."""
        tp.shard_linear(self.q, group, 0)
        tp.shard_linear(self.kv, group, 0, chunks=2)
        norms = [self.norm_q, self.norm_k]
        if self.image_kv is not None:
            tp.shard_linear(self.image_kv, group, 0, chunks=2)
            norms.append(self.norm_image_k)
        tp.shard_linear(self.out, group, 1)
        self._shard_heads(group, norms)

    def _attend(self, q, kv: nn.Linear, norm_k: RMSWeight, context, pack: Pack):
        """q's attention to each sample's whole context [samples, context_len, hidden]."""
        n, c, d = context.shape
        k, v = kv(tp.column_input(context.reshape(n * c, d), self.tp_group)).chunk(2, dim=-1)
        k = self.head_norm(k, norm_k).view(n * c, self.heads, -1)
        cu_k = torch.arange(0, (n + 1) * c, c, device=q.device, dtype=torch.int32)
        return self.ops.packed_attention(q, k, v.reshape(n * c, self.heads, -1), pack.local_cu, cu_k, None, pack.max_len, c)

    def forward(self, x: torch.Tensor, context: torch.Tensor, pack: Pack, image_context: torch.Tensor | None = None) -> torch.Tensor:
        """x: [tokens, hidden]; context: [samples, context_len, hidden], every sample's whole
        context attended (Wan pads the text states to a fixed length and attends to all of it);
        image_context (image-to-video): the projected image features, attended apart and added."""
        t = x.shape[0]
        q = self.head_norm(self.q(tp.column_input(x, self.tp_group)), self.norm_q).view(t, self.heads, -1)
        o = self._attend(q, self.kv, self.norm_k, context, pack)
        if image_context is not None:
            o = o + self._attend(q, self.image_kv, self.norm_image_k, image_context, pack)
        return tp.row_linear(self.out, o.reshape(t, -1), self.tp_group)


class ImageEmbedding(nn.Module):
    """The CLIP image features' projection (diffusers' WanImageEmbedding): fp32 LayerNorm, GELU
    MLP, fp32 LayerNorm."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d_in), nn.LayerNorm(d_out)
        self.fc1, self.fc2 = nn.Linear(d_in, d_in), nn.Linear(d_in, d_out)

    def forward(self, x):
        h = _fp32_layer_norm(x, self.norm1)
        h = self.fc2(F.gelu(self.fc1(h)))
        return _fp32_layer_norm(h, self.norm2)


def _fp32_layer_norm(x, norm: nn.LayerNorm):
    return F.layer_norm(x.float(), norm.normalized_shape, norm.weight.float(), norm.bias.float(), norm.eps).to(x.dtype)


class RMSWeight(nn.Module):
    """An RMSNorm's weight (the op table computes the norm)."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))


class WanBlock(nn.Module):
    def __init__(self, cfg: WanConfig, ops: OpTable):
        super().__init__()
        d = cfg.hidden_size
        self.eps = cfg.eps
        self.modulation = nn.Parameter(torch.randn(1, 6, d) / d**0.5)
        self.self_attn = SelfAttention(cfg, ops)
        self.cross_norm = nn.LayerNorm(d, eps=cfg.eps) if cfg.cross_attn_norm else None
        self.cross_attn = CrossAttention(cfg, ops)
        self.fc1, self.fc2 = nn.Linear(d, cfg.ffn_dim), nn.Linear(cfg.ffn_dim, d)
        self.tp_group = None

    def shard(self, group) -> None:
        """Keep this TP rank's share of the attentions' heads and of the MLP's hidden units."""
        self.self_attn.shard(group)
        self.cross_attn.shard(group)
        tp.shard_linear(self.fc1, group, 0)
        tp.shard_linear(self.fc2, group, 1)
        self.tp_group = group

    def forward(self, x, context, time_mod, cos, sin, pack: Pack, image_context=None):
        """time_mod: [samples or tokens, 6, hidden] (fp32), the block's shift/scale/gate inputs."""
        mod = (self.modulation.float() + time_mod).unbind(1)
        shift, scale, gate, c_shift, c_scale, c_gate = mod
        d = x.shape[-1]
        h = modulate(F.layer_norm(x.float(), (d,), eps=self.eps), shift, scale, pack).type_as(x)
        x = (x.float() + self.self_attn(h, cos, sin, pack) * _per_token(gate, pack)).type_as(x)
        if self.cross_norm is not None:
            h = F.layer_norm(x.float(), (d,), self.cross_norm.weight.float(), self.cross_norm.bias.float(), self.eps).type_as(x)
        else:
            h = x
        x = x + self.cross_attn(h, context, pack, image_context)
        h = modulate(F.layer_norm(x.float(), (d,), eps=self.eps), c_shift, c_scale, pack).type_as(x)
        ff = tp.mlp(self.fc1, self.fc2, h, self.tp_group)
        return (x.float() + ff.float() * _per_token(c_gate, pack)).type_as(x)


class WanDiT(tp.MegatronCheckpointable, nn.Module):
    """`model(patches, pack, timestep, context)`: samples of any sizes in one pack (`patchify`);
    `predict(model, ...)` takes diffusers' arguments. `tp_group`: the model is built whole (the
    same seed on every rank gives the same weights), then each block keeps this rank's share."""

    def __init__(self, cfg: WanConfig, ops: OpTable | None = None, tp_group=None):
        super().__init__()
        cfg.check()
        ops = ops or OpTable()
        self.cfg, self.ops = cfg, ops
        d = cfg.hidden_size
        self.patch_embedding = nn.Conv3d(cfg.in_channels, d, kernel_size=tuple(cfg.patch_size), stride=tuple(cfg.patch_size))
        self.time_in = MLP2(cfg.freq_dim, d, nn.SiLU())
        self.time_proj = nn.Linear(d, 6 * d)
        self.text_in = MLP2(cfg.text_dim, d, nn.GELU(approximate="tanh"))
        if cfg.image_dim is not None:
            self.image_in = ImageEmbedding(cfg.image_dim, d)
        self.layers = nn.ModuleList(WanBlock(cfg, ops) for _ in range(cfg.num_layers))
        self.proj_out = nn.Linear(d, cfg.out_channels * cfg.patch_volume)
        self.out_modulation = nn.Parameter(torch.randn(1, 2, d) / d**0.5)
        if tp_group is not None:
            for block in self.layers:
                block.shard(tp_group)

    def blocks(self) -> list[nn.Module]:
        """The transformer blocks: the unit of FSDP sharding and activation recompute."""
        return list(self.layers)

    def rope_angles(self, pack: Pack) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's cos / sin [tokens, 1, head_dim / 2]: the angles of its time, height and
        width positions side by side (float64 angles, as diffusers makes them, then fp32)."""
        limit = self.cfg.rope_max_seq_len
        extent = max(max(g) for g in pack.grids)
        if extent > limit:
            raise ValueError(f"a sample {extent} patches long along one axis exceeds rope_max_seq_len={limit}")
        device = self.patch_embedding.weight.device
        axes = [torch.outer(torch.arange(extent, dtype=torch.float64, device=device), inv.to(device)) for inv in rope_inv_freqs(self.cfg)]
        angles = []
        for f, h, w in pack.grids:
            t_, h_, w_ = (a[:n] for a, n in zip(axes, (f, h, w)))
            angles.append(
                torch.cat(
                    [
                        t_.view(f, 1, 1, -1).expand(f, h, w, -1),
                        h_.view(1, h, 1, -1).expand(f, h, w, -1),
                        w_.view(1, 1, w, -1).expand(f, h, w, -1),
                    ],
                    dim=-1,
                ).reshape(f * h * w, 1, -1)
            )
        a = torch.cat(angles)
        return a.cos().float(), a.sin().float()

    # -- forward -------------------------------------------------------------------------------

    def forward(
        self, patches: torch.Tensor, pack: Pack, timestep: torch.Tensor, context: torch.Tensor, cp_group=None, image_context=None
    ) -> torch.Tensor:
        """patches [tokens, channels * patch volume] of `pack`; timestep [samples] (or [tokens]:
        one time per token, Wan2.2 TI2V's per-patch times); context [samples, context_len, text_dim]
        -> predictions [tokens, out_channels * patch volume]. With `cp_group` (Ulysses context
        parallel) every rank of the group gets the whole micro-batch and returns the rows of its
        `local_range` of the tokens. image_context [samples, image tokens, image_dim]: the CLIP
        image features of an image-to-video model (its patches then hold the condition channels
        too, as the I2V pipeline concatenates them)."""
        if (image_context is None) != (self.cfg.image_dim is None):
            raise ValueError("image_context is required by an image-to-video model and taken by no other")
        total = patches.shape[0]
        if cp_group is not None:
            patches, pack, timestep, context, image_context = _pad_for(cp_group, patches, pack, timestep, context, image_context)
        w = self.patch_embedding.weight
        x = F.linear(patches[pack.start : pack.end].to(w.dtype), w.flatten(1), self.patch_embedding.bias)
        temb = self.time_in(timestep_features(timestep, self.cfg.freq_dim).to(self.time_in.fc1.weight.dtype))
        if timestep.shape[0] == pack.total and len(pack.grids) != timestep.shape[0]:
            temb = temb[pack.start : pack.end]  # one time per token: this rank's tokens'
            pack = dataclasses.replace(pack, token_times=True)
        time_mod = self.time_proj(F.silu(temb)).float().unflatten(1, (6, -1))
        context = self.text_in(context.to(self.text_in.fc1.weight.dtype))
        if image_context is not None:
            image_context = self.image_in(image_context.to(self.image_in.fc1.weight.dtype))
        cos, sin = self.rope_angles(pack)
        cos, sin = cos[pack.start : pack.end], sin[pack.start : pack.end]
        for block in self.layers:
            x = block(x, context, time_mod, cos, sin, pack, image_context)
        shift, scale = (self.out_modulation.float() + temb.float()[:, None]).unbind(1)
        x = modulate(F.layer_norm(x.float(), (x.shape[-1],), eps=self.cfg.eps), shift, scale, pack).type_as(x)
        return self.proj_out(x[: max(0, min(pack.end, total) - pack.start)])


class WanExperts(tp.MegatronCheckpointable, nn.Module):
    """Wan2.2 A14B's two transformers of one shape: `high` denoises times t >= boundary (the
    high-noise stages), `low` the rest, as WanPipeline's `transformer` / `transformer_2` with
    `boundary_ratio`. Called like `WanDiT`: each sample of the pack goes to its expert by its time,
    and both experts run in every call (an expert without samples runs on one all-zero token
    whose output is multiplied by 0), so every data-parallel rank runs the same collectives
    whatever its samples' times. Under context parallelism each expert splits its own samples'
    tokens over the group (the group's ranks hold the same samples and times, so route alike)."""

    def __init__(self, cfg: WanConfig, boundary: float, ops: OpTable | None = None, tp_group=None):
        super().__init__()
        self.cfg, self.boundary = cfg, boundary
        self.high, self.low = WanDiT(cfg, ops, tp_group), WanDiT(cfg, ops, tp_group)

    def blocks(self) -> list[nn.Module]:
        return self.high.blocks() + self.low.blocks()

    def expert_for(self, t: torch.Tensor) -> torch.Tensor:
        """True where time t goes to the high-noise expert."""
        return t >= self.boundary

    def routes(self, pack: Pack, timestep: torch.Tensor) -> list[tuple[WanDiT, list[int], torch.Tensor]]:
        """(expert, its samples, their rows of the pack) of the high then the low expert."""
        n = len(pack.grids)
        if timestep.shape[0] != n:
            raise ValueError("two-expert Wan routes by each sample's time; per-token times are not supported")
        high = self.expert_for(timestep).tolist()
        cu = pack.cu_seqlens.tolist()
        res = []
        for expert, picks in ((self.high, [i for i in range(n) if high[i]]), (self.low, [i for i in range(n) if not high[i]])):
            rows = torch.cat([torch.arange(cu[i], cu[i + 1]) for i in picks]) if picks else torch.zeros(0, dtype=torch.long)
            res.append((expert, picks, rows.to(pack.cu_seqlens.device)))
        return res

    def forward(self, patches, pack: Pack, timestep, context, cp_group=None):
        """With `cp_group` each expert splits its own samples' tokens over the group, and this rank
        returns its rows of the high expert's then of the low expert's (`cp_rows`)."""
        outs, unused = [], []
        for expert, picks, rows in self.routes(pack, timestep):
            if not picks:  # one zero token through the expert, times 0: the same collectives on every rank
                zero = expert(
                    patches.new_zeros(1, patches.shape[1]), Pack.of([(1, 1, 1)], patches.device), timestep[:1] * 0, context[:1] * 0
                )
                unused.append(zero.sum() * 0)
                continue
            sub = Pack.of([pack.grids[i] for i in picks], patches.device)
            outs.append((rows, expert(patches[rows], sub, timestep[picks], context[picks], cp_group)))
        if cp_group is not None:
            out = torch.cat([pred for _, pred in outs])
        else:
            out = outs[0][1].new_zeros(patches.shape[0], outs[0][1].shape[1])
            for rows, pred in outs:
                out = out.index_copy(0, rows, pred)
        return out + unused[0] if unused else out


def cp_rows(model: nn.Module, pack: Pack, timestep: torch.Tensor, group) -> torch.Tensor:
    """The rows of `pack` whose predictions `model(..., cp_group=group)` returns on this rank, in
    its order: the rank's `local_range` of the row, or of each expert's samples' rows."""
    parts = [rows for _, _, rows in model.routes(pack, timestep)] if isinstance(model, WanExperts) else [torch.arange(pack.total)]
    rank, size = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
    return torch.cat([p[slice(*local_range(len(p), rank, size))] for p in parts]).to(pack.cu_seqlens.device)


def _pad_for(group, patches, pack: Pack, timestep, context, image_context=None):
    """The row padded to a multiple of the group's size with one dummy sample (its own attention,
    time 0, an all-zero context and image context; its rows are dropped from the output), and this
    rank's slice."""
    total = patches.shape[0]
    pad, start, end = padded_range(total, group)
    grids = list(pack.grids)
    if pad:
        per_token = timestep.shape[0] == total and len(grids) != total
        patches = torch.cat([patches, patches.new_zeros(pad, patches.shape[1])])
        grids.append((1, 1, pad))
        timestep = torch.cat([timestep, timestep.new_zeros(pad if per_token else 1)])
        context, image_context = (None if c is None else torch.cat([c, c.new_zeros(1, *c.shape[1:])]) for c in (context, image_context))
    return patches, Pack.of(grids, patches.device, start, end, group), timestep, context, image_context


def patchify(latents: list[torch.Tensor], cfg: WanConfig, as_output: bool = False) -> tuple[torch.Tensor, Pack]:
    """Latents [channels, frames, height, width] each -> patch rows [tokens, channels * patch
    volume] and their pack. A row is laid out as the patch convolution's kernel (channel, then
    offset in the patch) or, `as_output`, as the model's output rows (offset, then channel): the
    layout to compare predictions with."""
    pt, ph, pw = cfg.patch_size
    rows, grids = [], []
    for x in latents:
        c, f, h, w = x.shape
        want = cfg.out_channels if as_output else cfg.in_channels
        if c != want or f % pt or h % ph or w % pw:
            raise ValueError(f"latents {tuple(x.shape)}: expected {want} channels and sizes divisible by the patch {list(cfg.patch_size)}")
        g = (f // pt, h // ph, w // pw)
        order = (1, 3, 5, 2, 4, 6, 0) if as_output else (1, 3, 5, 0, 2, 4, 6)
        rows.append(x.reshape(c, g[0], pt, g[1], ph, g[2], pw).permute(*order).reshape(math.prod(g), -1))
        grids.append(g)
    return torch.cat(rows), Pack.of(grids, latents[0].device)


def unpatchify(out: torch.Tensor, pack: Pack, cfg: WanConfig) -> list[torch.Tensor]:
    """Prediction rows [tokens, out_channels * patch volume] -> [out_channels, frames, height, width] each."""
    pt, ph, pw = cfg.patch_size
    res = []
    for (f, h, w), seg in zip(pack.grids, out.split(torch.diff(pack.cu_seqlens).tolist())):
        x = seg.reshape(f, h, w, pt, ph, pw, -1).permute(6, 0, 3, 1, 4, 2, 5)
        res.append(x.reshape(-1, f * pt, h * ph, w * pw))
    return res


def predict(
    model: WanDiT,
    hidden_states: torch.Tensor,
    timestep: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    encoder_hidden_states_image=None,
) -> torch.Tensor:
    """diffusers' call: latents [batch, channels, frames, height, width], timestep [batch] (or
    [batch, tokens]: one time per patch token), text states [batch, context_len, text_dim]
    (image-to-video: and CLIP image features [batch, image tokens, image_dim]) -> the prediction
    [batch, out_channels, frames, height, width]."""
    patches, pack = patchify(list(hidden_states), model.cfg)
    t = timestep.reshape(-1) if timestep.dim() == 2 else timestep
    out = model(patches, pack, t, encoder_hidden_states, image_context=encoder_hidden_states_image)
    return torch.stack(unpatchify(out, pack, model.cfg))


def rope_inv_freqs(cfg: WanConfig) -> list[torch.Tensor]:
    """The time, height and width groups' rotary frequencies (float64)."""
    return [1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)) for d in cfg.rope_dims()]
