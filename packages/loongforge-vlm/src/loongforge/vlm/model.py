"""A vision-language model composed of core parts: a vision tower whose patch merger projects to
the language model's width (Qwen2.5-VL's or Qwen3-VL's ViT), and a decoder family of core's
foundation (Qwen2, Llama, Qwen3) with M-RoPE positions. Samples run packed (THD): every sample's
tokens in one row, each image's merged features in place of its `<|image_pad|>` tokens, and each
token's M-RoPE angles handed to every attention layer with the pack
(`foundation.layers.rotary_pack_class`); Qwen3-VL's DeepStack features ride with the pack too and
are added to the first language layers' outputs at the vision tokens.

HF checkpoints (`Qwen2_5_VLForConditionalGeneration`, `Qwen3VLForConditionalGeneration`) map by
`vlm_table`: the architecture's vision table under its prefix and the language family's own
table, the names published checkpoints and `save_pretrained` write.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict

import torch
from loongforge.core.errors import UserError
from loongforge.core.foundation import hf_io
from loongforge.core.foundation.hf_mapping import hf_to_lf, lf_to_hf, prefixed
from loongforge.core.foundation.llava_onevision import (
    LlavaOnevisionConfig,
    LlavaOnevisionVision,
    image_token_count,
    llava_onevision_vision_table,
    num_image_tiles,
    video_token_count,
)
from loongforge.core.foundation.lora import merged_state
from loongforge.core.foundation.model import load_lf_state, local_state
from loongforge.core.foundation.mrope import IMAGE, TEXT, VIDEO, mrope_positions, mrope_tables
from loongforge.core.foundation.qwen2_5_vl_vision import QWEN25_VISION_TABLE, Qwen25VisionConfig, Qwen25VisionTower, grid_rows
from loongforge.core.foundation.qwen3_vl_vision import QWEN3_VISION_TABLE, Qwen3VisionConfig, Qwen3VisionTower
from loongforge.core.foundation.spec import FamilySpec, ModelConfig, build_gpt_model
from loongforge.core.ops import OpTable
from loongforge.core.ops.reference import rope_inv_freq
from loongforge.vlm.data.encode import CLIP_MEAN, CLIP_STD
from torch import nn


@dataclass(frozen=True)
class VLMArch:
    """One HF VLM architecture: its vision tower, its inputs and the names its checkpoints use."""

    name: str  # `model.arch`, the HF model_type
    hf_architecture: str
    family: str  # the language family of its HF checkpoints
    vision_config: type
    tower: type
    vision_table: tuple  # HF names as transformers 5 writes them
    language_names: tuple  # (causal-LM name prefix, this architecture's) for the language model's HF names
    grids: bool  # vision items given as (t, h, w) patch grids with M-RoPE positions (Qwen-VL); else LLaVA's image sizes, 1-D positions
    frames_apart: bool  # video frames each their own vision item (timestamps between them)
    image_mean: tuple  # the family's image normalization (its preprocessor_config.json)
    image_std: tuple
    hf_ids: tuple  # (our token id field, the HF config's key)
    tokens: tuple  # (our token id field, the token's text in the family's tokenizer)
    projector: tuple  # the tower's parameter name prefixes that project into the language model
    text_model_type: str | None  # its text_config's model_type (None: the family's own)
    vision_from_hf: Callable[[dict], Any]  # the tower's config from the HF config.json
    vision_to_hf: Callable[[Any], dict]  # the HF config.json entries of the vision side (given the VLMConfig)
    legacy_vision_table: tuple | None = None  # HF names of checkpoints written by transformers 4, where they differ


QWEN_TOKENS = (
    ("image_token_id", "<|image_pad|>"),
    ("video_token_id", "<|video_pad|>"),
    ("vision_start_token_id", "<|vision_start|>"),
    ("vision_end_token_id", "<|vision_end|>"),
)
QWEN_IDS = tuple((k, k) for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"))
ARCHS = {
    a.name: a
    for a in (
        VLMArch(
            name="qwen2_5_vl",
            hf_architecture="Qwen2_5_VLForConditionalGeneration",
            family="qwen2",
            vision_config=Qwen25VisionConfig,
            tower=Qwen25VisionTower,
            vision_table=prefixed(QWEN25_VISION_TABLE, "", "visual."),
            language_names=(),
            grids=True,
            frames_apart=False,
            image_mean=CLIP_MEAN,
            image_std=CLIP_STD,
            hf_ids=QWEN_IDS,
            tokens=QWEN_TOKENS,
            projector=("merger",),
            text_model_type="qwen2_5_vl_text",
            vision_from_hf=lambda c: Qwen25VisionConfig.from_hf(c.get("vision_config") or {}),
            # its video time positions' rate sits in its vision_config
            vision_to_hf=lambda c: {
                "vision_config": {**c.tower.hf_config(), "model_type": "qwen2_5_vl_vision", "tokens_per_second": c.tokens_per_second}
            },
        ),
        VLMArch(
            name="qwen3_vl",
            hf_architecture="Qwen3VLForConditionalGeneration",
            family="qwen3",
            vision_config=Qwen3VisionConfig,
            tower=Qwen3VisionTower,
            vision_table=prefixed(QWEN3_VISION_TABLE, "", "model.visual."),
            language_names=(("model.", "model.language_model."),),
            grids=True,
            frames_apart=True,
            image_mean=(0.5, 0.5, 0.5),
            image_std=(0.5, 0.5, 0.5),
            hf_ids=QWEN_IDS,
            tokens=QWEN_TOKENS,
            projector=("merger", "deepstack_mergers"),
            text_model_type="qwen3_vl_text",
            vision_from_hf=lambda c: Qwen3VisionConfig.from_hf(c.get("vision_config") or {}),
            vision_to_hf=lambda c: {"vision_config": {**c.tower.hf_config(), "model_type": "qwen3_vl_vision"}},
        ),
        VLMArch(
            name="llava_onevision",
            hf_architecture="LlavaOnevisionForConditionalGeneration",
            family="qwen2",
            vision_config=LlavaOnevisionConfig,
            tower=LlavaOnevisionVision,
            vision_table=llava_onevision_vision_table(),
            language_names=(("model.", "language_model.model."), ("lm_head.", "language_model.lm_head.")),
            grids=False,
            frames_apart=False,
            image_mean=(0.5, 0.5, 0.5),
            image_std=(0.5, 0.5, 0.5),
            hf_ids=(("image_token_id", "image_token_index"), ("video_token_id", "video_token_index")),
            tokens=(("image_token_id", "<image>"), ("video_token_id", "<video>")),
            projector=("projector_", "image_newline"),
            text_model_type=None,
            vision_from_hf=LlavaOnevisionConfig.from_hf,
            vision_to_hf=lambda c: c.tower.hf_config(),
            legacy_vision_table=llava_onevision_vision_table(tower_prefix="vision_tower.vision_model."),
        ),
    )
}
VISION_PLACEHOLDERS = {"i": "v", "j": "vd"}  # the tower's rows' placeholders beside the language model's


def vlm_arch(name: str) -> VLMArch:
    if name not in ARCHS:
        raise UserError(f"model.arch={name!r} is not a supported VLM architecture (supported: {', '.join(ARCHS)})")
    return ARCHS[name]


@dataclass
class VLMConfig:
    """The composed model: vision tower, language model and the special token ids that join them."""

    arch: str = "qwen2_5_vl"  # the vision tower, its inputs and the checkpoint layout: qwen2_5_vl | qwen3_vl | llava_onevision
    vision: Dict[str, Any] = field(default_factory=dict)  # the arch's vision tower's fields (`tower`)
    language: ModelConfig = field(default_factory=lambda: ModelConfig(family="qwen2"))
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    tokens_per_second: int = 2  # video: M-RoPE time positions per second of video

    @functools.cached_property
    def tower(self):
        """The arch's vision config from `vision` (its defaults where not given; a UserError naming
        a field the arch's tower does not have), built on first use: `vision` is not changed after."""
        kind = vlm_arch(self.arch).vision_config
        known = {f.name for f in dataclasses.fields(kind)}
        unknown = sorted(set(self.vision) - known)
        if unknown:
            raise UserError(
                f"model.vision.{unknown[0]} is not a field of the {self.arch} vision tower (fields: {', '.join(sorted(known))})"
            )
        hints = typing.get_type_hints(kind)
        return kind(
            **{k: hints[k](**v) if dataclasses.is_dataclass(hints[k]) and isinstance(v, dict) else v for k, v in self.vision.items()}
        )

    # the mapping rows' placeholders and fused-q/k/v transforms read these
    def repeats(self) -> dict[str, int]:
        return {**self.language.repeats(), **{VISION_PLACEHOLDERS[k]: n for k, n in self.tower.repeats().items()}}

    @property
    def deepstack_layers(self) -> int:
        """How many first language layers get DeepStack features added (Qwen3-VL)."""
        return len(self.vision.get("deepstack_visual_indexes", ()))

    @property
    def num_query_groups(self) -> int:
        return self.language.num_query_groups

    @property
    def num_attention_heads(self) -> int:
        return self.language.num_attention_heads

    @property
    def kv_channels(self) -> int:
        return self.language.kv_channels

    @property
    def tie_word_embeddings(self) -> bool:
        return self.language.tie_word_embeddings

    def check(self) -> None:
        """The parts against each other: one UserError naming the key."""
        lang, vis = self.language, self.tower
        if vis.out_hidden_size != lang.hidden_size:
            raise UserError(
                f"model.vision.out_hidden_size={vis.out_hidden_size} must equal model.language.hidden_size={lang.hidden_size} "
                "(the patch merger projects into the language model)"
            )
        rot = int(lang.kv_channels * lang.rotary_percent) // 2
        if lang.mrope_section is not None and sum(lang.mrope_section) != rot:
            raise UserError(
                f"model.language.mrope_section={list(lang.mrope_section)} must sum to the {rot} rotary pairs of a head "
                f"(head_dim {lang.kv_channels} / 2)"
            )
        if self.deepstack_layers > lang.num_layers:
            raise UserError(
                f"model.vision.deepstack_visual_indexes has {self.deepstack_layers} layers but the language model only "
                f"{lang.num_layers} to add them to"
            )
        for k, _ in vlm_arch(self.arch).hf_ids:
            if not 0 <= getattr(self, k) < lang.vocab_size:
                raise UserError(f"model.{k}={getattr(self, k)} is outside the vocabulary (model.language.vocab_size={lang.vocab_size})")


def vlm_table(family: FamilySpec, arch: str, legacy: bool = False) -> tuple:
    """HF checkpoint names <-> ours: the tower's rows under `vision.` (HF: the architecture's names;
    `legacy`: those of transformers 4 files where they differ), the family's rows under `language.`
    (HF: its causal-LM names placed as the architecture places its language model)."""
    a = vlm_arch(arch)

    def hf_name(h: str) -> str:
        for old, new in a.language_names:
            if h.startswith(old):
                return new + h.removeprefix(old)
        return h

    def language(row):
        return dataclasses.replace(row, lf="language." + row.lf, hf=tuple(map(hf_name, row.hf)))

    vision = a.legacy_vision_table if legacy and a.legacy_vision_table else a.vision_table
    return (*prefixed(vision, "vision.", "", VISION_PLACEHOLDERS), *map(language, family.mapping))


def hf_state_table(family: FamilySpec, arch: str, keys) -> tuple:
    """`vlm_table` for a checkpoint holding `keys`: its transformers 4 names where it has them."""
    a = vlm_arch(arch)
    if not a.legacy_vision_table:
        return vlm_table(family, arch)
    own = {h for r in a.legacy_vision_table for h in r.hf} - {h for r in a.vision_table for h in r.hf}
    return vlm_table(family, arch, legacy=any(h in keys for h in own))


class VisionLanguageModel(nn.Module):
    """`model(tokens, positions, cu_seqlens, pixel_values=, image_grid_thw=, ...)` on one THD pack
    (tokens [1, T], positions [3, T] M-RoPE rows restarting per sample, cu_seqlens [samples + 1]):
    logits [1, T, vocab], or with `labels` / `loss_weights` [1, T] the weighted loss sum.
    `model(input_ids=..., attention_mask=..., pixel_values=..., ...)`, the HF processor's outputs
    as the HF model takes them: logits [batch, seq, vocab] (`hf_logits`)."""

    def __init__(self, cfg: VLMConfig, family: FamilySpec, vision: nn.Module, language: nn.Module):
        super().__init__()
        self.cfg, self.family = cfg, family
        self.vision, self.language = vision, language
        lang = cfg.language
        inv = rope_inv_freq(int(lang.kv_channels * lang.rotary_percent), lang.rope_theta, lang.rope_scaling)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.sections = list(lang.mrope_section) if lang.mrope_section else [inv.numel(), 0, 0]
        self.interleaved = lang.mrope_interleaved

    @classmethod
    def build(
        cls,
        family: FamilySpec,
        cfg: VLMConfig,
        ctx,
        ops: OpTable | None = None,
        params_dtype=torch.float32,
        recompute=False,
        lora=None,
        vision_recompute=False,
    ):
        """`recompute`: the language model's layers' activations recomputed in backward;
        `vision_recompute`: the vision tower's blocks'."""
        cfg = dataclasses.replace(cfg, language=family.resolve(cfg.language))
        cfg.check()
        ops = ops or OpTable()
        language = build_gpt_model(cfg.language, ctx, ops, params_dtype, recompute, lora)
        arch = vlm_arch(cfg.arch)
        vision = arch.tower(cfg.tower, ops).to(params_dtype) if ctx.is_first_stage else None
        if cfg.deepstack_layers and ctx.is_first_stage:
            from loongforge.core.foundation.layers import add_layer_additions

            layers = [layer for layer in language.decoder.layers if layer.layer_number <= cfg.deepstack_layers]
            if len(layers) < cfg.deepstack_layers:
                raise UserError(
                    f"the first pipeline stage holds {len(layers)} language layers but DeepStack adds features to the first "
                    f"{cfg.deepstack_layers}: lower parallel.pipeline_model_parallel_size"
                )
            add_layer_additions(layers)
        if vision is not None and vision_recompute:
            from loongforge.core.stacks.torch_native import recompute_block

            for block in vision.blocks if isinstance(vision.blocks, nn.ModuleList) else vision.blocks():
                recompute_block(block)
        if vision is not None:
            from loongforge.core.parallel.split_data import SPLIT_DATA_ATTR

            for p in vision.parameters():  # each TP rank encodes its share of the images
                setattr(p, SPLIT_DATA_ATTR, True)
        return cls(cfg, family, vision, language)

    @property
    def post_process(self) -> bool:
        return self.language.post_process

    def set_input_tensor(self, tensor) -> None:
        """Pipeline stages after the first: the previous stage's activations (the ViT and the
        embedding live on the first stage)."""
        self.language.set_input_tensor(tensor)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """megatron dist_checkpointing's view: the language model's shards under `language.`, the
        vision tower's tensors (replicated on every rank of its stage) under `vision.`."""
        from megatron.core.transformer.utils import sharded_state_dict_default

        sd = self.language.sharded_state_dict(prefix=f"{prefix}language.", sharded_offsets=sharded_offsets, metadata=metadata)
        if self.vision is not None:
            sd.update(
                sharded_state_dict_default(self.vision, f"{prefix}vision.", sharded_offsets, metadata, tp_group=self.language.tp_group)
            )
        return sd

    def embed(self, tokens, image_index=None, video_index=None, **vision_inputs):
        """(token embeddings [T, 1, hidden] with the vision features in place of the pad tokens,
        each DeepStack layer's additions [T, 1, hidden] (zero off the vision tokens; Qwen3-VL)).
        `vision_inputs`: the HF processor's names (`pixel_values`, `image_grid_thw` or
        `image_sizes`, ...). `image_index` / `video_index`: the pad tokens' positions, found on the
        host (`vision_index`), spare the host sync that placing features by a device mask costs in
        backward."""
        x = self.language.embedding(input_ids=tokens, position_ids=None)
        deep = [torch.zeros_like(x) for _ in range(self.cfg.deepstack_layers)]
        for kind, pad, index in (("image", self.cfg.image_token_id, image_index), ("video", self.cfg.video_token_id, video_index)):
            feats = self.item_features(kind, vision_inputs, x.dtype)
            n = 0 if feats is None else feats[0].shape[0]
            if index is not None:
                if index.numel() != n:
                    raise ValueError(f"{index.numel()} pad tokens {pad} but {n} vision features for them")
                if feats is not None:
                    x = x.index_put((index,), feats[0][:, None])
                    deep = [d.index_put((index,), f[:, None]) for d, f in zip(deep, feats[1:])]
                continue
            mask = (tokens == pad).transpose(0, 1)[..., None]  # [T, 1, 1]
            _check_count(mask, n, pad)
            if feats is not None:
                x = x.masked_scatter(mask, feats[0])
                deep = [d.masked_scatter(mask, f) for d, f in zip(deep, feats[1:])]
        return x, deep

    def item_features(self, kind: str, inputs: dict, dtype) -> list[torch.Tensor] | None:
        """The features of the pack's images or videos (`kind`) from the processor's outputs, then
        each DeepStack layer's; None without pixels."""
        pixels = inputs.get("pixel_values" if kind == "image" else "pixel_values_videos")
        if pixels is None:
            return None
        tower = self.cfg.tower
        if vlm_arch(self.cfg.arch).grids:
            rows = grid_rows(inputs[f"{kind}_grid_thw"])
            sizes = [t * h * w for t, h, w in rows]
            first = [0, *itertools.accumulate(sizes)]
            counts = [n // tower.spatial_merge_size**2 for n in sizes]
            return self.split_features(sizes, counts, lambda a, b: self._encode(pixels[first[a] : first[b]], rows[a:b]), dtype)
        if kind == "video":  # [videos, frames, channels, size, size]
            frames = pixels.shape[1]
            costs, counts = [frames] * pixels.shape[0], [video_token_count(tower, frames)] * pixels.shape[0]
            return self.split_features(costs, counts, lambda a, b: [self.vision.video_features(pixels[a:b])], dtype)
        sizes, multi = self.vision.image_layout(inputs["image_sizes"], inputs.get("batch_num_images"))
        tiles = self.vision.image_tiles(pixels, sizes, multi)
        costs = [num_image_tiles(tower, h, w, m) for (h, w), m in zip(sizes, multi)]
        first = [0, *itertools.accumulate(costs)]
        counts = [image_token_count(tower, h, w, m) for (h, w), m in zip(sizes, multi)]
        return self.split_features(
            costs, counts, lambda a, b: [self.vision.image_features(tiles[first[a] : first[b]], sizes[a:b], multi[a:b])], dtype
        )

    def split_features(self, costs: list[int], counts: list[int], encode, dtype) -> list[torch.Tensor]:
        """[the features of every vision item of the pack, in order, then each DeepStack layer's]:
        `encode(a, b)` gives items a..b-1's ([rows, hidden] each; `counts` rows per item). With
        TP > 1 each rank of the language model's TP group (which share the pack) encodes a
        contiguous share of the items, near-equal by `costs`, and the shares are gathered: the
        vision tower is data parallel over all ranks."""
        group = self.language.tp_group
        if group is None or group.size() == 1:
            return [f.to(dtype) for f in encode(0, len(costs))]
        from loongforge.core.parallel.split_data import gather_rows, split_items

        bounds = split_items(costs, group.size())
        start, stop = bounds[group.rank()]
        if stop > start:
            mine = encode(start, stop)
        else:
            empty = self.language.embedding.word_embeddings.weight.new_zeros(0, self.cfg.language.hidden_size, dtype=dtype)
            mine = [empty] * (1 + self.cfg.deepstack_layers)
        return [gather_rows(f.to(dtype), group, [sum(counts[a:b]) for a, b in bounds]) for f in mine]

    def _encode(self, pixels, grid) -> list[torch.Tensor]:
        out = self.vision(pixels, grid)
        return [out[0], *out[1]] if isinstance(out, tuple) else [out]

    def rotary_pack(self, positions: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int | None = None):
        """The pack's bounds with each token's M-RoPE tables; `max_seqlen` (its longest sample)
        from the data side spares a host sync."""
        from loongforge.core.foundation.layers import rotary_pack_class

        cos, sin = mrope_tables(positions, self.inv_freq, self.sections, self.interleaved)
        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if max_seqlen is None else int(max_seqlen)
        cu = cu_seqlens.to(torch.int32)
        return rotary_pack_class()(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest, rotary_cos=cos, rotary_sin=sin
        )

    def forward(
        self,
        tokens=None,
        positions=None,
        cu_seqlens=None,
        labels=None,
        loss_weights=None,
        decoder_input=None,
        max_seqlen=None,
        **vision_inputs,
    ):
        if tokens is None and "input_ids" in vision_inputs:  # called as HF's model is: the processor's outputs
            return self.hf_logits(**vision_inputs)
        packed = self.rotary_pack(positions, cu_seqlens, max_seqlen)
        if self.vision is not None and decoder_input is None:
            decoder_input, deep = self.embed(tokens, **vision_inputs)
            packed.layer_additions = dict(enumerate(deep)) or None
        return self.language(
            tokens, None, None, decoder_input=decoder_input, labels=labels, loss_mask=loss_weights, packed_seq_params=packed
        )

    # ---- HF processor outputs in, logits out ------------------------------------------------

    @torch.no_grad()
    def hf_logits(self, input_ids, attention_mask=None, mm_token_type_ids=None, second_per_grid_ts=None, **vision) -> torch.Tensor:
        """HF-style call (the processor's outputs as keyword arguments: `pixel_values`,
        `image_grid_thw` / `image_sizes`, ...): a padded batch -> logits [batch, seq, vocab] (zeros
        at padding). Each row's kept tokens become one sample of a pack."""
        b, s = input_ids.shape
        keep = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        types = token_types(self.cfg, input_ids) if mm_token_type_ids is None else mm_token_type_ids
        grids = vision.get("image_grid_thw"), vision.get("video_grid_thw")
        rows, positions, lens, start = [], [], [], (0, 0)
        for r in range(b):
            ids = input_ids[r][keep[r]]
            pos, start = sample_positions(self.cfg, types[r][keep[r]], *grids, second_per_grid_ts, start)
            rows.append(ids)
            positions.append(pos)
            lens.append(len(ids))
        tokens = torch.cat(rows)[None]
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=input_ids.device)
        logits = self(tokens, torch.cat(positions, dim=1).to(input_ids.device), cu, **vision)
        out = logits.new_zeros(b, s, logits.shape[-1])
        out[keep] = logits[0]
        return out

    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens: int, eos_token_id: int | None = None, **vision_inputs) -> torch.Tensor:
        """Greedy decoding (full recompute per token: a correctness path); token types follow the ids."""
        vision_inputs.pop("mm_token_type_ids", None)
        out = input_ids
        for _ in range(max_new_tokens):
            nxt = self.hf_logits(out, **vision_inputs)[:, -1].argmax(-1, keepdim=True)
            out = torch.cat([out, nxt], dim=1)
            if eos_token_id is not None and bool((nxt == eos_token_id).all()):
                break
        return out

    # ---- HF checkpoints ---------------------------------------------------------------------

    def lf_state(self, merged: bool = False) -> dict:
        """The whole TP=1 state dict; `merged`: LoRA adapters folded into their base weights."""
        language = merged_state(self.language) if merged else local_state(self.language)
        state = {f"language.{k}": v for k, v in language.items()}
        if self.vision is not None:
            state.update({f"vision.{k}": v for k, v in self.vision.state_dict().items()})
        return state

    def load_lf(self, state: dict) -> None:
        """Load a whole TP=1 LoongForge state dict (`vision.*` and `language.*`)."""
        load_lf_state(self.language, {k.removeprefix("language."): v for k, v in state.items() if k.startswith("language.")})
        vision = {k.removeprefix("vision."): v for k, v in state.items() if k.startswith("vision.")}
        try:
            self.vision.load_state_dict(vision, strict=True)
        except RuntimeError as e:
            raise UserError(f"vision weights do not fit the model: {str(e).splitlines()[0]}") from None

    def hf_state_dict(self) -> dict:
        return lf_to_hf(vlm_table(self.family, self.cfg.arch), self.lf_state(merged=True), self.cfg)

    def save_hf(self, out_dir, dtype: torch.dtype = torch.float32) -> None:
        arch = vlm_arch(self.cfg.arch)
        if self.family.name != arch.family:
            raise UserError(
                f"HF export writes {arch.hf_architecture}, whose language model is {arch.family}; this model's is {self.family.name}"
            )
        hf_io.save_hf_dir(out_dir, hf_config(self.cfg, self.family, dtype), self.hf_state_dict(), dtype)

    @classmethod
    def from_hf(cls, hf_dir, families: dict, ctx, ops=None) -> "VisionLanguageModel":
        family, cfg = read_hf_config(hf_dir, families)
        model = cls.build(family, cfg, ctx, ops)
        state = hf_io.load_hf_state(hf_dir)
        model.load_lf(hf_to_lf(hf_state_table(family, cfg.arch, state), state, model.cfg))
        return model


def vision_index(cfg: VLMConfig, tokens: torch.Tensor) -> dict:
    """The image and video pad tokens' positions in a pack's tokens [1, T] (on the host), as
    `embed` takes them."""
    row = tokens.reshape(-1)
    return {
        f"{kind}_index": (row == pad).nonzero().squeeze(1) for kind, pad in (("image", cfg.image_token_id), ("video", cfg.video_token_id))
    }


def _check_count(mask: torch.Tensor, features: int, pad: int) -> None:
    """The pad tokens must be as many as the vision features put in their place: checked on the
    device (no host sync) where the tokens live there."""
    if mask.device.type != "cpu":
        torch._assert_async(mask.sum() == features, f"the number of pad tokens {pad} differs from the {features} vision features")
    elif int(mask.sum()) != features:
        raise ValueError(f"{int(mask.sum())} pad tokens {pad} but {features} vision features for them")


def token_types(cfg: VLMConfig, ids: torch.Tensor) -> torch.Tensor:
    """TEXT / IMAGE / VIDEO per token (HF processors' `mm_token_type_ids`)."""
    types = torch.full_like(ids, TEXT)
    types[ids == cfg.image_token_id] = IMAGE
    types[ids == cfg.video_token_id] = VIDEO
    return types


def sample_positions(cfg: VLMConfig, types: torch.Tensor, image_grid_thw=None, video_grid_thw=None, second_per_grid_ts=None, start=(0, 0)):
    """M-RoPE rows [3, T] of one sample's token types, its images and videos the grids from index
    `start` on; returns (rows, the indices after this sample's items)."""
    counts = [_items(types, kind) for kind in (IMAGE, VIDEO)]
    after = (start[0] + counts[0], start[1] + counts[1])
    if not vlm_arch(cfg.arch).grids:  # 1-D positions
        return torch.arange(len(types)).expand(3, -1).clone(), after
    merge = cfg.tower.spatial_merge_size
    grids = [[] if g is None else [tuple(r) for r in g.tolist()] for g in (image_grid_thw, video_grid_thw)]
    if vlm_arch(cfg.arch).frames_apart:  # each frame its own item at time 0 (timestamps in the text between)
        grids[1] = [(1, h, w) for t, h, w in grids[1] for _ in range(t)]
    seconds = [] if second_per_grid_ts is None else [float(s) for s in second_per_grid_ts]
    pos = mrope_positions(
        types.tolist(),
        grids[0][start[0] : start[0] + counts[0]],
        grids[1][start[1] : start[1] + counts[1]],
        seconds[start[1] : start[1] + counts[1]] or [1.0] * counts[1],
        merge,
        cfg.tokens_per_second,
    )
    return pos, after


def _items(types: torch.Tensor, kind: int) -> int:
    """How many runs of `kind` tokens (images or videos) a sample holds."""
    t = (types == kind).int()
    return int(((t[1:] - t[:-1]) == 1).sum() + t[0]) if len(t) else 0


def read_hf_config(hf_dir, families: dict) -> tuple[FamilySpec, VLMConfig]:
    """A Qwen2.5-VL, Qwen3-VL or LLaVA-OneVision directory's config: nested (transformers 5:
    `text_config`) or flat (Qwen2.5-VL's published checkpoints: text keys at the top)."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise UserError(f"{hf_dir}: not an HF model directory (no config.json)")
    c = json.loads(path.read_text())
    if c.get("model_type") not in ARCHS:
        raise UserError(f"{hf_dir}: model_type {c.get('model_type')!r} is not a supported VLM (supported: {', '.join(ARCHS)})")
    arch = ARCHS[c["model_type"]]
    ids = dict(arch.hf_ids)
    if "text_config" in c:
        text = dict(c["text_config"])
    else:
        text = {k: v for k, v in c.items() if k not in ("vision_config", *ids.values(), "architectures")}
    text["model_type"] = arch.text_model_type or text.get("model_type", families[arch.family].hf_model_type)
    text["tie_word_embeddings"] = bool(c.get("tie_word_embeddings") or text.get("tie_word_embeddings"))
    family, lang = hf_io.model_config_from_hf(text, families, hf_dir)
    cfg = VLMConfig(
        arch=arch.name,
        vision=dataclasses.asdict(arch.vision_from_hf(c)),
        language=family.resolve(lang),
        tokens_per_second=int((c.get("vision_config") or {}).get("tokens_per_second", 2)),
        **{k: int(c[h]) for k, h in ids.items() if h in c},
    )
    return family, cfg


def hf_config(cfg: VLMConfig, family: FamilySpec, dtype=torch.float32) -> dict:
    arch = vlm_arch(cfg.arch)
    text = hf_io.hf_config_dict(family, cfg.language, dtype)
    text.pop("architectures")
    text["model_type"] = arch.text_model_type or text["model_type"]
    return {
        "architectures": [arch.hf_architecture],
        "model_type": arch.name,
        **arch.vision_to_hf(cfg),
        "text_config": text,
        "tie_word_embeddings": cfg.language.tie_word_embeddings,
        "dtype": text["dtype"],
        **{h: getattr(cfg, k) for k, h in arch.hf_ids},
    }


def vlm_config_from_dict(d: dict) -> VLMConfig:
    """A VLMConfig from its asdict form (a manifest's or a run config's `model`)."""
    return VLMConfig(language=ModelConfig(**d["language"]), **{k: v for k, v in d.items() if k != "language"})
