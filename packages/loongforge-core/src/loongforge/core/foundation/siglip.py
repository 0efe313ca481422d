"""SigLIP's vision tower as a plain torch module, with its HF mapping table.

The tower of HF `SiglipVisionModel` without the pooling head (PaliGemma and the VLA policies use
every patch's final hidden state): a patch convolution plus learned position embeddings, pre-norm
encoder layers (LayerNorm, bidirectional multi-head attention with biases, a GELU-tanh MLP) and a
final LayerNorm. q/k/v are one fused linear (one GEMM); `SIGLIP_VISION_TABLE` maps it to HF's
three, so HF weights load and export through the same `hf_to_lf` / `lf_to_hf` as the decoders.
HF names are relative to the tower: transformers 5 names `SiglipVisionModel`'s tensors so, files
saved by transformers 4 (and PaliGemma / pi0 checkpoints) put `vision_model.` before them
(`hf_mapping.prefixed` adds it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from loongforge.core.foundation.hf_mapping import Row
from loongforge.core.ops import OpTable
from torch import nn


@dataclass
class SiglipVisionConfig:
    """Shape of the tower; HF `SiglipVisionConfig`'s fields under the names used across core."""

    num_layers: int = 2
    hidden_size: int = 32
    num_attention_heads: int = 4
    ffn_hidden_size: int = 64
    image_size: int = 28
    patch_size: int = 14
    num_channels: int = 3
    norm_eps: float = 1e-6

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def repeats(self) -> dict[str, int]:
        return {"i": self.num_layers}

    def hf_config(self) -> dict:
        """The HF `SiglipVisionConfig` fields of this shape."""
        return {
            "num_hidden_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "intermediate_size": self.ffn_hidden_size,
            "image_size": self.image_size,
            "patch_size": self.patch_size,
            "num_channels": self.num_channels,
            "layer_norm_eps": self.norm_eps,
            "hidden_act": "gelu_pytorch_tanh",
        }

    @classmethod
    def from_hf(cls, d: dict) -> "SiglipVisionConfig":
        act = d.get("hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            from loongforge.core.errors import UserError

            raise UserError(f"SigLIP vision config: hidden_act={act!r} is not supported (only gelu_pytorch_tanh)")
        return cls(
            num_layers=d["num_hidden_layers"],
            hidden_size=d["hidden_size"],
            num_attention_heads=d["num_attention_heads"],
            ffn_hidden_size=d["intermediate_size"],
            image_size=d["image_size"],
            patch_size=d["patch_size"],
            num_channels=d.get("num_channels", 3),
            norm_eps=d.get("layer_norm_eps", 1e-6),
        )


V = "layers.{i}."
E = "encoder.layers.{i}."

SIGLIP_VISION_TABLE = (
    Row("patch_embed.weight", ("embeddings.patch_embedding.weight",)),
    Row("patch_embed.bias", ("embeddings.patch_embedding.bias",)),
    Row("pos_embed.weight", ("embeddings.position_embedding.weight",)),
    Row(V + "norm1.weight", (E + "layer_norm1.weight",)),
    Row(V + "norm1.bias", (E + "layer_norm1.bias",)),
    Row(V + "qkv.weight", tuple(E + f"self_attn.{p}_proj.weight" for p in "qkv"), "concat"),
    Row(V + "qkv.bias", tuple(E + f"self_attn.{p}_proj.bias" for p in "qkv"), "concat"),
    Row(V + "proj.weight", (E + "self_attn.out_proj.weight",)),
    Row(V + "proj.bias", (E + "self_attn.out_proj.bias",)),
    Row(V + "norm2.weight", (E + "layer_norm2.weight",)),
    Row(V + "norm2.bias", (E + "layer_norm2.bias",)),
    Row(V + "fc1.weight", (E + "mlp.fc1.weight",)),
    Row(V + "fc1.bias", (E + "mlp.fc1.bias",)),
    Row(V + "fc2.weight", (E + "mlp.fc2.weight",)),
    Row(V + "fc2.bias", (E + "mlp.fc2.bias",)),
    Row("final_norm.weight", ("post_layernorm.weight",)),
    Row("final_norm.bias", ("post_layernorm.bias",)),
)


class SiglipEncoderLayer(nn.Module):
    def __init__(self, cfg: SiglipVisionConfig, ops: OpTable):
        super().__init__()
        h = cfg.hidden_size
        self.heads, self.eps, self.ops = cfg.num_attention_heads, cfg.norm_eps, ops
        self.norm1 = nn.LayerNorm(h, eps=cfg.norm_eps)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.norm2 = nn.LayerNorm(h, eps=cfg.norm_eps)
        self.fc1 = nn.Linear(h, cfg.ffn_hidden_size)
        self.fc2 = nn.Linear(cfg.ffn_hidden_size, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self._norm(self.norm1, x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        attn = self.ops.attention(q, k, v, causal=False)  # [b, heads, s, d]
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(self.ops.gelu(self.fc1(self._norm(self.norm2, x)), "tanh"))

    def _norm(self, norm: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
        return self.ops.layer_norm(x, norm.weight, norm.bias, self.eps)


class SiglipVisionTower(nn.Module):
    """`tower(pixels)`: images [b, channels, size, size] -> patch features [b, patches, hidden]."""

    def __init__(self, cfg: SiglipVisionConfig, ops: OpTable | None = None):
        super().__init__()
        ops = ops or OpTable()
        self.cfg, self.ops = cfg, ops
        self.patch_embed = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size, stride=cfg.patch_size)
        self.pos_embed = nn.Embedding(cfg.num_patches, cfg.hidden_size)
        self.layers = nn.ModuleList(SiglipEncoderLayer(cfg, ops) for _ in range(cfg.num_layers))
        self.final_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        size = self.cfg.image_size
        if pixels.dim() != 4 or tuple(pixels.shape[1:]) != (self.cfg.num_channels, size, size):
            raise ValueError(f"SigLIP tower takes images [batch, {self.cfg.num_channels}, {size}, {size}], got {tuple(pixels.shape)}")
        x = self.embed(pixels)
        for layer in self.layers:
            x = layer(x)
        return self.ops.layer_norm(x, self.final_norm.weight, self.final_norm.bias, self.cfg.norm_eps)

    def embed(self, pixels: torch.Tensor) -> torch.Tensor:
        """Patch and position embeddings [b, patches, hidden] in the layers' dtype."""
        # The convolution's output is channel-major: without `contiguous` every residual add of
        # the tower would keep that transposed layout, and every norm would copy its input first.
        x = self.patch_embed(pixels.to(self.patch_embed.weight.dtype)).flatten(2).transpose(1, 2).contiguous()
        x = x + self.pos_embed.weight.to(x.dtype)
        if len(self.layers):  # the embeddings may be kept in fp32 beside bf16 layers
            x = x.to(self.layers[0].qkv.weight.dtype)
        return x

    def blocks(self) -> list[nn.Module]:
        """The encoder layers: the unit of FSDP sharding and activation recompute."""
        return list(self.layers)
