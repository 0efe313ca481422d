"""Qwen-Image (MMDiT) on core's op table, with its diffusers mapping table.

The math of diffusers' `QwenImageTransformer2DModel`: an image stream (packed 2x2 latent patches)
and a text stream (Qwen2.5-VL states, RMS-normed) with their own weights, modulated per stream
from the time embedding, meeting in one joint attention over [text, image] per sample; q/k
RMSNorm per head; RoPE on both streams (image: frame, and height / width centred on the image;
text: positions after the image's largest half-side, on every axis), applied to adjacent channel
pairs; GELU-tanh MLPs; an adaptive output norm and projection of the image stream.

Samples of different sizes (and different text lengths) run packed: the image tokens of every
sample in one row, the real text tokens in another, each sample's joint attention over its own
text and image tokens only (op `packed_attention`). Padded text positions are dropped, which is
what diffusers' text mask computes.

With a `tp_group` (tensor parallelism, the megatron stack) each rank keeps its share of both
streams' heads and MLP units (`core.parallel.tensor_parallel`).

Under Ulysses context parallelism each rank holds a slice of the image row and the whole (short)
text stream: the joint attention gets every image token by all-to-all and the text tokens' share
of the heads by a slice, and the text outputs' heads are gathered back onto every rank.
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
from loongforge.core.parallel import tensor_parallel as tp
from loongforge.core.parallel.split_data import SPLIT_DATA_ATTR
from loongforge.core.parallel.ulysses import gather_heads, head_share, heads_to_seq, padded_range, seq_to_heads
from loongforge.diffusion.models.wan import MLP2, RMSWeight, diffusers_fields, lens_in, sample_rows, timestep_features
from torch import nn

UNSUPPORTED = ("guidance_embeds", "zero_cond_t", "use_additional_t_cond", "use_layer3d_rope")


@dataclass
class QwenImageConfig:
    """The transformer's shape under diffusers' config names (`QwenImageTransformer2DModel`)."""

    patch_size: int = 2
    in_channels: int = 16  # packed: latent channels x patch_size^2
    out_channels: int = 4
    num_layers: int = 2
    attention_head_dim: int = 16
    num_attention_heads: int = 2
    joint_attention_dim: int = 24
    axes_dims_rope: List[int] = field(default_factory=lambda: [4, 6, 6])

    @property
    def hidden_size(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    def repeats(self) -> dict[str, int]:
        return {"i": self.num_layers}

    def check(self) -> None:
        if sum(self.axes_dims_rope) != self.attention_head_dim or any(d % 2 for d in self.axes_dims_rope):
            raise UserError(
                f"model.axes_dims_rope={list(self.axes_dims_rope)}: three even sizes summing to attention_head_dim={self.attention_head_dim}"
            )

    def diffusers_config(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {
            "_class_name": "QwenImageTransformer2DModel",
            **d,
            "axes_dims_rope": list(self.axes_dims_rope),
            **{k: False for k in UNSUPPORTED},
        }

    @classmethod
    def from_diffusers(cls, d: dict) -> "QwenImageConfig":
        refused = {k: "is not implemented (Qwen-Image text-to-image configs only)" for k in UNSUPPORTED}
        cfg = cls(**diffusers_fields(cls, d, "QwenImageTransformer2DModel", refused))
        cfg.axes_dims_rope = list(cfg.axes_dims_rope)
        cfg.out_channels = cfg.out_channels or cfg.in_channels
        cfg.check()
        return cfg


B, L = "transformer_blocks.{i}.", "layers.{i}."

QWEN_IMAGE_TABLE = (
    Row("time_in.fc1.weight", ("time_text_embed.timestep_embedder.linear_1.weight",)),
    Row("time_in.fc1.bias", ("time_text_embed.timestep_embedder.linear_1.bias",)),
    Row("time_in.fc2.weight", ("time_text_embed.timestep_embedder.linear_2.weight",)),
    Row("time_in.fc2.bias", ("time_text_embed.timestep_embedder.linear_2.bias",)),
    Row("txt_norm.weight", ("txt_norm.weight",)),
    Row("img_in.weight", ("img_in.weight",)),
    Row("img_in.bias", ("img_in.bias",)),
    Row("txt_in.weight", ("txt_in.weight",)),
    Row("txt_in.bias", ("txt_in.bias",)),
    *(
        row
        for s, theirs in (
            ("img", ("to_q", "to_k", "to_v", "to_out.0", "norm_q", "norm_k")),
            ("txt", ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "norm_added_q", "norm_added_k")),
        )
        for row in (
            Row(L + f"{s}_mod.weight", (B + f"{s}_mod.1.weight",)),
            Row(L + f"{s}_mod.bias", (B + f"{s}_mod.1.bias",)),
            Row(L + f"{s}_qkv.weight", tuple(B + f"attn.{t}.weight" for t in theirs[:3]), "concat"),
            Row(L + f"{s}_qkv.bias", tuple(B + f"attn.{t}.bias" for t in theirs[:3]), "concat"),
            Row(L + f"{s}_out.weight", (B + f"attn.{theirs[3]}.weight",)),
            Row(L + f"{s}_out.bias", (B + f"attn.{theirs[3]}.bias",)),
            Row(L + f"{s}_norm_q.weight", (B + f"attn.{theirs[4]}.weight",)),
            Row(L + f"{s}_norm_k.weight", (B + f"attn.{theirs[5]}.weight",)),
            Row(L + f"{s}_fc1.weight", (B + f"{s}_mlp.net.0.proj.weight",)),
            Row(L + f"{s}_fc1.bias", (B + f"{s}_mlp.net.0.proj.bias",)),
            Row(L + f"{s}_fc2.weight", (B + f"{s}_mlp.net.2.weight",)),
            Row(L + f"{s}_fc2.bias", (B + f"{s}_mlp.net.2.bias",)),
        )
    ),
    Row("out_mod.weight", ("norm_out.linear.weight",)),
    Row("out_mod.bias", ("norm_out.linear.bias",)),
    Row("proj_out.weight", ("proj_out.weight",)),
    Row("proj_out.bias", ("proj_out.bias",)),
)


@dataclass
class JointPack:
    """Packed samples: `img_shapes[i]` = sample i's (frames, height, width) in patches and
    `text_lens[i]` its real text tokens; joint rows are [text_i, image_i] per sample. Under
    context parallelism (`cp_group`) this rank holds image tokens [start, end) of the image row
    between attentions (`local_sample`: each one's sample, `local_lens`: each sample's count of
    them) and every text token."""

    img_shapes: list[tuple[int, int, int]]
    text_lens: list[int]
    img_sample: torch.Tensor  # each image token's sample
    txt_sample: torch.Tensor
    cu_joint: torch.Tensor
    to_joint: torch.Tensor  # cat([text rows, image rows])[to_joint] is the joint order
    max_len: int
    local_sample: torch.Tensor
    local_lens: list[int]
    start: int = 0
    end: int = 0
    cp_group: object = None

    @property
    def img_lens(self) -> list[int]:
        return [f * h * w for f, h, w in self.img_shapes]

    @classmethod
    def of(cls, img_shapes, text_lens, device, start: int = 0, end: int | None = None, cp_group=None) -> "JointPack":
        img = [f * h * w for f, h, w in img_shapes]
        end = sum(img) if end is None else end
        order, o_img, o_txt = [], sum(text_lens), 0
        for n_txt, n_img in zip(text_lens, img):
            order += list(range(o_txt, o_txt + n_txt)) + list(range(o_img, o_img + n_img))
            o_txt, o_img = o_txt + n_txt, o_img + n_img
        joint = [a + b for a, b in zip(text_lens, img)]
        ar = torch.arange(len(img), device=device)
        img_sample = torch.repeat_interleave(ar, torch.tensor(img, device=device))
        return cls(
            list(img_shapes),
            list(text_lens),
            img_sample,
            torch.repeat_interleave(ar, torch.tensor(text_lens, device=device)),
            F.pad(torch.tensor(joint, device=device).cumsum(0), (1, 0)).to(torch.int32),
            torch.tensor(order, device=device),
            max(joint),
            img_sample[start:end],
            lens_in(img, start, end),
            start,
            end,
            cp_group,
        )


class JointBlock(nn.Module):
    def __init__(self, cfg: QwenImageConfig, ops: OpTable):
        super().__init__()
        d, hd = cfg.hidden_size, cfg.attention_head_dim
        self.heads, self.ops, self.tp_group = cfg.num_attention_heads, ops, None
        for s in ("img", "txt"):
            setattr(self, f"{s}_mod", nn.Linear(d, 6 * d))
            setattr(self, f"{s}_qkv", nn.Linear(d, 3 * d))
            setattr(self, f"{s}_out", nn.Linear(d, d))
            setattr(self, f"{s}_norm_q", RMSWeight(hd))
            setattr(self, f"{s}_norm_k", RMSWeight(hd))
            setattr(self, f"{s}_fc1", nn.Linear(d, 4 * d))
            setattr(self, f"{s}_fc2", nn.Linear(4 * d, d))

    def shard(self, group) -> None:
        """Keep this TP rank's share of the heads and of the MLPs' hidden units (both streams). The
        per-head q/k norms stay whole, applied to this rank's heads only: their gradients are
        summed over the group (`SPLIT_DATA_ATTR`)."""
        for s in ("img", "txt"):
            tp.shard_linear(getattr(self, f"{s}_qkv"), group, 0, chunks=3)
            tp.shard_linear(getattr(self, f"{s}_out"), group, 1)
            tp.shard_linear(getattr(self, f"{s}_fc1"), group, 0)
            tp.shard_linear(getattr(self, f"{s}_fc2"), group, 1)
            for norm in ("norm_q", "norm_k"):
                setattr(getattr(self, f"{s}_{norm}").weight, SPLIT_DATA_ATTR, True)
        self.heads //= torch.distributed.get_world_size(group)
        self.tp_group = group

    def _qkv(self, s: str, x, mod, cos, sin):
        """One stream's modulated q / k / v [tokens, heads, head_dim], normed and rotated."""
        h = tp.column_input(_modulate(F.layer_norm(x, x.shape[-1:], eps=1e-6), mod[0], mod[1]), self.tp_group)
        q, k, v = getattr(self, f"{s}_qkv")(h).unflatten(-1, (3, self.heads, -1)).unbind(1)
        q = self.ops.rms_norm(q, getattr(self, f"{s}_norm_q").weight, 1e-6)
        k = self.ops.rms_norm(k, getattr(self, f"{s}_norm_k").weight, 1e-6)
        q, k = self.ops.rotary(q, k, cos, sin, True)
        return q, k, v

    def forward(self, img, txt, temb_img, temb_txt, angles, pack: JointPack):
        """temb_*: [samples, hidden]; angles: ((cos, sin) of the image rows, of the text rows)."""
        mi = self.img_mod(F.silu(temb_img)).chunk(6, dim=-1)
        mt = self.txt_mod(F.silu(temb_txt)).chunk(6, dim=-1)
        gi, gt = pack.local_sample, pack.txt_sample
        mi, mt = [sample_rows(m, gi, pack.local_lens) for m in mi], [sample_rows(m, gt, pack.text_lens) for m in mt]
        qi, ki, vi = self._qkv("img", img, (mi[0], mi[1]), *angles[0])
        qt, kt, vt = self._qkv("txt", txt, (mt[0], mt[1]), *angles[1])
        g = pack.cp_group
        if g is not None:  # every image token and every text token, for this rank's share of the heads
            qi, ki, vi = (seq_to_heads(u, g) for u in (qi, ki, vi))
            qt, kt, vt = (head_share(u, g) for u in (qt, kt, vt))
        joint = [torch.cat([t, i])[pack.to_joint] for t, i in ((qt, qi), (kt, ki), (vt, vi))]
        o = self.ops.packed_attention(*joint, pack.cu_joint, pack.cu_joint, None, pack.max_len, pack.max_len)
        o = torch.empty_like(o).index_copy_(0, pack.to_joint, o)  # back to [text rows, image rows]
        ot, oi = o[: txt.shape[0]], o[txt.shape[0] :]
        if g is not None:
            ot, oi = gather_heads(ot, g), heads_to_seq(oi, g)
        ot, oi = ot.flatten(1), oi.flatten(1)
        img = img + mi[2] * tp.row_linear(self.img_out, oi, self.tp_group)
        txt = txt + mt[2] * tp.row_linear(self.txt_out, ot, self.tp_group)
        h = _modulate(F.layer_norm(img, img.shape[-1:], eps=1e-6), mi[3], mi[4])
        img = img + mi[5] * tp.mlp(self.img_fc1, self.img_fc2, h, self.tp_group)
        h = _modulate(F.layer_norm(txt, txt.shape[-1:], eps=1e-6), mt[3], mt[4])
        txt = txt + mt[5] * tp.mlp(self.txt_fc1, self.txt_fc2, h, self.tp_group)
        return img, txt


def _modulate(x, shift, scale):
    return x * (1 + scale) + shift


class QwenImageDiT(tp.MegatronCheckpointable, nn.Module):
    """`model(img_tokens, txt_states, timestep, pack)`: packed image tokens [tokens, in_channels],
    real text states [text tokens, joint_attention_dim], times [samples] in [0, 1] (diffusers'
    convention for this model) -> [tokens, patch^2 * out_channels]. `tp_group`: built whole, then
    each block keeps this rank's share of the heads (tensor parallel)."""

    def __init__(self, cfg: QwenImageConfig, ops: OpTable | None = None, tp_group=None):
        super().__init__()
        cfg.check()
        ops = ops or OpTable()
        self.cfg, self.ops = cfg, ops
        d = cfg.hidden_size
        self.time_in = MLP2(256, d, nn.SiLU())
        self.txt_norm = RMSWeight(cfg.joint_attention_dim)
        self.img_in = nn.Linear(cfg.in_channels, d)
        self.txt_in = nn.Linear(cfg.joint_attention_dim, d)
        self.layers = nn.ModuleList(JointBlock(cfg, ops) for _ in range(cfg.num_layers))
        self.out_mod = nn.Linear(d, 2 * d)
        self.proj_out = nn.Linear(d, cfg.patch_size**2 * cfg.out_channels)
        if tp_group is not None:
            for block in self.layers:
                block.shard(tp_group)

    def blocks(self) -> list[nn.Module]:
        return list(self.layers)

    def rope_angles(self, pack: JointPack):
        """(cos, sin) [tokens, 1, head_dim / 2] of the image rows and of the text rows."""
        device = self.img_in.weight.device
        invs = [1.0 / torch.pow(10000, torch.arange(0, d, 2, device=device).float().div(d)) for d in self.cfg.axes_dims_rope]
        img, txt = [], []
        for (f, h, w), n in zip(pack.img_shapes, pack.text_lens):
            pos = [
                torch.arange(f, device=device),
                torch.cat([torch.arange(-(h - h // 2), 0, device=device), torch.arange(h // 2, device=device)]),  # centred
                torch.cat([torch.arange(-(w - w // 2), 0, device=device), torch.arange(w // 2, device=device)]),
            ]
            a = [torch.outer(p.float(), inv) for p, inv in zip(pos, invs)]
            img.append(
                torch.cat(
                    [
                        a[0].view(f, 1, 1, -1).expand(f, h, w, -1),
                        a[1].view(1, h, 1, -1).expand(f, h, w, -1),
                        a[2].view(1, 1, w, -1).expand(f, h, w, -1),
                    ],
                    dim=-1,
                ).reshape(f * h * w, -1)
            )
            tpos = torch.arange(max(h // 2, w // 2), max(h // 2, w // 2) + n, device=device).float()
            txt.append(torch.cat([torch.outer(tpos, inv) for inv in invs], dim=-1))
        return tuple((torch.cat(x).cos()[:, None], torch.cat(x).sin()[:, None]) for x in (img, txt))

    def forward(self, img_tokens, txt_states, timestep, pack: JointPack, cp_group=None):
        """With `cp_group` (Ulysses context parallel) every rank of the group gets the whole
        micro-batch and returns the rows of its `local_range` of the image tokens; each runs the
        text stream whole."""
        total = img_tokens.shape[0]
        if cp_group is not None:  # the image row padded to a multiple of the group by one dummy sample (no text, time 0)
            pad, start, end = padded_range(total, cp_group)
            shapes, text_lens = list(pack.img_shapes), list(pack.text_lens)
            if pad:
                img_tokens = torch.cat([img_tokens, img_tokens.new_zeros(pad, img_tokens.shape[1])])
                shapes, text_lens, timestep = shapes + [(1, 1, pad)], text_lens + [0], torch.cat([timestep, timestep.new_zeros(1)])
            pack = JointPack.of(shapes, text_lens, img_tokens.device, start, end, cp_group)
        img = self.img_in(img_tokens[pack.start : pack.end])
        temb = self.time_in(timestep_features(timestep * 1000, 256).to(img.dtype))
        txt = self.txt_in(self.ops.rms_norm(txt_states, self.txt_norm.weight, 1e-6))
        (cos, sin), text_angles = self.rope_angles(pack)
        angles = ((cos[pack.start : pack.end], sin[pack.start : pack.end]), text_angles)
        for block in self.layers:
            img, txt = block(img, txt, temb, temb, angles, pack)
        scale, shift = self.out_mod(F.silu(temb)).chunk(2, dim=-1)
        gi, lens = pack.local_sample, pack.local_lens
        img = _modulate(F.layer_norm(img, img.shape[-1:], eps=1e-6), sample_rows(shift, gi, lens), sample_rows(scale, gi, lens))
        return self.proj_out(img[: max(0, min(pack.end, total) - pack.start)])


def pack_latents(latents: torch.Tensor, p: int) -> torch.Tensor:
    """Image latents [channels, 1, h, w] -> patch rows [h / p * w / p, channels * p * p], each row
    (channel, row in the patch, column in the patch): QwenImagePipeline's `_pack_latents`."""
    c, f, h, w = latents.shape
    if f != 1 or h % p or w % p:
        raise ValueError(f"latents {tuple(latents.shape)}: one frame with sides divisible by {p}")
    return latents.reshape(c, h // p, p, w // p, p).permute(1, 3, 0, 2, 4).reshape((h // p) * (w // p), c * p * p)


def unpack_latents(rows: torch.Tensor, h: int, w: int, p: int) -> torch.Tensor:
    """The inverse of `pack_latents` for latents of sides h x w: [channels, 1, h, w]."""
    return rows.reshape(h // p, w // p, -1, p, p).permute(2, 0, 3, 1, 4).reshape(-1, 1, h, w)


def predict(model: QwenImageDiT, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, timestep, img_shapes) -> torch.Tensor:
    """diffusers' call: packed latents [batch, tokens, in_channels], text states [batch, L, D] with
    their mask [batch, L] (None: all real), times [batch] in [0, 1], img_shapes (per sample a list
    holding its (frames, height, width) in patches) -> [batch, tokens, patch^2 * out_channels]."""
    b, n_img = hidden_states.shape[:2]
    shapes = (
        [tuple(s[0]) if isinstance(s, list) else tuple(s) for s in img_shapes][:b]
        if len(img_shapes) >= b
        else [tuple(img_shapes[0][0])] * b
    )
    mask = (
        torch.ones(encoder_hidden_states.shape[:2], dtype=torch.bool, device=hidden_states.device)
        if encoder_hidden_states_mask is None
        else encoder_hidden_states_mask.bool()
    )
    if any(f * h * w != n_img for f, h, w in shapes):
        raise ValueError(f"img_shapes {shapes} do not hold {n_img} tokens each")
    pack = JointPack.of(shapes, mask.sum(1).tolist(), hidden_states.device)
    out = model(hidden_states.reshape(b * n_img, -1), encoder_hidden_states[mask], timestep, pack)
    return out.reshape(b, n_img, -1)
