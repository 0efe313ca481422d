"""The Wan training task: preprocessed latents + text states -> the flow-matching loss.

A micro-batch is `micro_batch_size` samples of any sizes, packed into one row of patch tokens
(no padding to the largest sample). Each sample draws its own noise level, noise and caption
dropout from a generator seeded by the micro-batch's first position, so a resumed run and any
data-parallel layout draw what one uninterrupted process would, and the ranks of a
context-parallel group (which share each micro-batch) draw alike: a two-expert model routes a
sample the same on each. The loss is each sample's mean squared velocity error times its sigma
weight, averaged over the global batch's samples (each sample counts once, whatever its size, as
the published recipes average).

Wan2.1 image-to-video (`model.image_dim`): each sample's transformer input is its noisy latents
concatenated on the channel axis with its condition, the first-frame mask (`first_frame_mask`,
model.in_channels - 2 x latent channels of them, 4 for Wan's VAE) and its condition latents
(the VAE latents of its first frame followed by zeros, from preprocessing), as
`WanImageToVideoPipeline` builds `torch.cat([latents, condition], dim=1)`; its first frame's CLIP
features go to the cross-attentions (`encoder_hidden_states_image`). The condition channels are
not noised and not predicted: the loss is the flow-matching loss of the latents alone (as
DiffSynth-Studio's Wan training conditions I2V: `WanVideoUnit_ImageEmbedderVAE` /
`WanVideoUnit_ImageEmbedderCLIP` on the training video's first frame, the condition clean).
"""

from __future__ import annotations

import zlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from loongforge.core.data import rank_micro_batches
from loongforge.core.data.mixture import DatasetMixture
from loongforge.core.errors import UserError
from loongforge.core.parallel.ulysses import local_range
from loongforge.core.train.task import TrainingTask
from loongforge.diffusion.data.encoders import first_frame_mask
from loongforge.diffusion.flow_matching import loss_weight, noised, sample_u, train_sigma
from loongforge.diffusion.models.wan import WanDiT, WanExperts, cp_rows, patchify


def pad_text(states: list[torch.Tensor], length: int) -> torch.Tensor:
    """Text states [L_i, D] each -> [n, length, D], zero-padded (cut past `length`), as Wan's
    pipeline pads its umT5 states."""
    return torch.stack([F.pad(s[:length], (0, 0, 0, length - min(len(s), length))) for s in states])


def build_transformer(cfg, ops=None, tp_group=None) -> torch.nn.Module:
    """The run's transformer: a Qwen-Image MMDiT, one Wan transformer, or Wan2.2 A14B's two
    (`boundary_ratio`), split over `tp_group` (tensor parallel) where given."""
    from loongforge.diffusion.models.qwen_image import QwenImageConfig, QwenImageDiT

    if isinstance(cfg.model, QwenImageConfig):
        return QwenImageDiT(cfg.model, ops, tp_group)
    if cfg.boundary_ratio is None:
        return WanDiT(cfg.model, ops, tp_group)
    return WanExperts(cfg.model, cfg.boundary_ratio * cfg.flow.num_train_timesteps, ops, tp_group)


class WanTask(TrainingTask):
    unit = "samples"

    def __init__(
        self,
        cfg,
        dataset,
        empty_text: torch.Tensor,
        data_rank: int,
        data_size: int,
        device,
        ops,
        load: Path | None = None,
        cp_group=None,
        tp_group=None,
        recompute: bool = False,
    ):
        """`data_rank` / `data_size`: this rank's share of the samples; `cp_group`: the ranks
        that split each micro-batch's tokens with this one (Ulysses context parallel), or None;
        `tp_group`: the ranks the model's heads split over (tensor parallel, the megatron
        stack), or None; `recompute`: the model recomputes each block (the megatron stack; the
        torch stack does it itself)."""
        self.cfg, self.dataset, self.data_rank, self.data_size, self.device, self.ops = cfg, dataset, data_rank, data_size, device, ops
        self.empty_text, self.load, self.cp_group, self.tp_group, self.recompute = empty_text, load, cp_group, tp_group, recompute
        self.order = DatasetMixture([dataset], [1.0], seed=cfg.data.seed)
        self.units_per_step = cfg.train.global_batch_size
        self.check_data(dataset)

    def check_data(self, dataset) -> None:
        """The latents and text states fit the model (one-line errors naming the mismatch)."""
        c, root = self.cfg.model, self.cfg.data.root
        channels, width = dataset.meta["latent_channels"], dataset.meta["text_dim"]
        if c.image_dim is not None:
            self.check_i2v_data(dataset)
        elif channels != c.in_channels or width != c.text_dim:
            raise UserError(
                f"{root}: latents of {channels} channels and text states of width {width}, "
                f"but model.in_channels={c.in_channels} and model.text_dim={c.text_dim}"
            )
        pt, ph, pw = c.patch_size
        shapes = dataset.shapes() if hasattr(dataset, "shapes") else []
        bad = next((i for i, (_, f, h, w) in enumerate(shapes) if f % pt or h % ph or w % pw), None)
        if bad is not None:
            raise UserError(
                f"{root}: sample {bad} has latents {tuple(shapes[bad])}, not divisible by model.patch_size={list(c.patch_size)}; "
                "preprocess with buckets whose sides divide by the VAE's stride times the patch"
            )

    def check_i2v_data(self, dataset) -> None:
        """Image-to-video: latents and condition latents of the model's out_channels, mask
        channels (the rest of in_channels), CLIP features of width model.image_dim."""
        c, root, meta = self.cfg.model, self.cfg.data.root, dataset.meta
        channels, width, image = meta["latent_channels"], meta["text_dim"], meta.get("image_dim")
        if image is None:
            raise UserError(
                f"{root}: no image features; model.image_dim (image-to-video) trains on a preprocessing output with an image encoder "
                "(preprocess --image-encoder, or frozen.image_encoder with data.root=demo)"
            )
        if channels != c.out_channels or c.in_channels - 2 * channels < 1 or width != c.text_dim or image != c.image_dim:
            raise UserError(
                f"{root}: latents of {channels} channels, text states of width {width} and image features of width {image}, but "
                f"model.in_channels={c.in_channels} (image-to-video: 2 x latent channels + 4 mask channels), "
                f"model.out_channels={c.out_channels}, model.text_dim={c.text_dim} and model.image_dim={c.image_dim}"
            )

    def build_model(self) -> torch.nn.Module:
        from loongforge.core.stacks.torch_native import recompute_block

        model = build_transformer(self.cfg, self.ops, self.tp_group).to(self.device)
        for block in model.blocks() if self.recompute else ():
            recompute_block(block)
        return model

    def micro_batch(self, positions: list[int]) -> dict:
        items = [self.dataset.get(self.order.index(p)[1]) for p in positions]
        mb = {
            "latents": [it["latents"].to(self.device) for it in items],
            "text": [it["text"] for it in items],
            "seed": zlib.crc32(f"flow:{self.cfg.data.seed}:{positions[0]}".encode()),
        }
        if getattr(self.cfg.model, "image_dim", None) is not None:  # image-to-video: the condition latents and CLIP features
            mb["condition"] = [it["condition"].to(self.device) for it in items]
            mb["image"] = [it["image"] for it in items]
        return mb

    def batches(self, start_step: int):
        t = self.cfg.train
        step = start_step
        while True:
            mbs = rank_micro_batches(step, t.global_batch_size, t.micro_batch_size, self.data_rank, self.data_size)
            yield [self.micro_batch(p) for p in mbs]
            step += 1

    def loss(self, model, mb):
        flow, n = self.cfg.flow, len(mb["latents"])
        g = torch.Generator(device=self.device).manual_seed(mb["seed"])
        # each sample's noise level: u shifted by flow.shift, or (flow.training_shift: dynamic) by
        # Qwen-Image's size-dependent shift at the sample's own token count
        sigma = train_sigma(flow, sample_u(flow, n, g, self.device), self.token_counts(mb["latents"]))
        drop = torch.rand(n, generator=g, device=self.device) < flow.caption_dropout
        texts = [self.empty_text if d else t for d, t in zip(drop.tolist(), mb["text"])]
        # Wan2.2 TI2V: a share of the samples keep their first latent frame clean, as the image
        # they are conditioned on (its tokens at time 0 and out of the loss)
        cond = [False] * n
        if flow.first_frame_condition > 0:
            cond = (torch.rand(n, generator=g, device=self.device) < flow.first_frame_condition).tolist()
        inputs, targets = [], []
        for x0, s, c in zip(mb["latents"], sigma, cond):
            noise = torch.randn(x0.shape, generator=g, device=self.device, dtype=x0.dtype)
            x_t, v = noised(x0, noise, s)
            if c:
                x_t = torch.cat([x0[:, :1], x_t[:, 1:]], dim=1)
            inputs.append(x_t)
            targets.append(v)
        images = None
        if "condition" in mb:  # image-to-video: [noisy latents, mask, condition latents] on the channel axis
            inputs = [torch.cat([x_t, self.mask(x_t), c.to(x_t.dtype)]) for x_t, c in zip(inputs, mb["condition"])]
            images = torch.stack(mb["image"]).to(self.device)
        pred, target, owner, lens, keep = self.predict_rows(model, inputs, targets, sigma, texts, cond, images)
        per_token = (pred.float() - target.float()).square().mean(-1)
        if keep is not None:
            per_token = per_token * keep
        sums = torch.zeros(n, device=self.device).index_add_(0, owner, per_token)
        weighted = sums / lens * loss_weight(flow, sigma)
        first = self.cp_group is None or dist.get_rank(self.cp_group) == 0  # each sample counted once
        return weighted.sum(), torch.tensor(float(n if first else 0), device=self.device), {}

    def mask(self, latents: torch.Tensor) -> torch.Tensor:
        """Image-to-video: the first-frame mask channels of latents [C, F', h, w]
        (`WanImageToVideoPipeline.prepare_latents`' `mask_lat_size`)."""
        _, f, h, w = latents.shape
        temporal = self.cfg.model.in_channels - 2 * latents.shape[0]
        return first_frame_mask(f, h, w, temporal, latents.dtype).to(latents.device)

    def token_counts(self, latents: list[torch.Tensor]) -> list[int]:
        """Each sample's patch-token count (what the size-dependent shift reads)."""
        pt, ph, pw = self.cfg.model.patch_size
        return [(f // pt) * (h // ph) * (w // pw) for _, f, h, w in (x.shape for x in latents)]

    def predict_rows(self, model, inputs, targets, sigma, texts, cond, images=None):
        """The family's part of the loss: (prediction rows, target rows, each row's sample, each
        sample's loss-token count, per-row loss weights or None) of this rank's tokens. images:
        image-to-video's CLIP features [samples, tokens, image_dim], or None."""
        flow = self.cfg.flow
        context = pad_text(texts, self.cfg.data.text_len).to(self.device)
        patches, pack = patchify(inputs, self.cfg.model)
        times = sigma * flow.num_train_timesteps
        lens = torch.diff(pack.cu_seqlens)
        keep = None
        if any(cond):
            clean = torch.tensor([h * w if c else 0 for (_, h, w), c in zip(pack.grids, cond)], device=self.device)  # first-frame tokens
            offset = torch.arange(patches.shape[0], device=self.device) - pack.cu_seqlens[pack.sample_of_token]
            keep = (offset >= clean[pack.sample_of_token]).float()
            times = times[pack.sample_of_token] * keep
            lens = lens - clean
        if images is None:
            pred = model(patches, pack, times, context, self.cp_group)
        else:
            pred = model(patches, pack, times, context, self.cp_group, image_context=images)
        target, _ = patchify(targets, self.cfg.model, as_output=True)
        if self.cp_group is None:
            return pred, target, pack.sample_of_token, lens, keep
        rows = cp_rows(model, pack, times, self.cp_group)  # this rank's tokens; their errors sum with the others' of its group
        return pred, target[rows], pack.sample_of_token[rows], lens, None if keep is None else keep[rows]

    def initial_weights(self, model, optimizer, stack) -> int:
        """A diffusers WanTransformer3DModel directory (two-expert runs: a Wan2.2 pipeline
        directory with transformer/ and transformer_2/) as the starting weights."""
        if self.load is None:
            return 0
        from loongforge.diffusion.model_io import read_transformers

        stack.load_full_state_dict(model, read_transformers(self.load, self.cfg))
        return 0


class QwenImageTask(WanTask):
    """Qwen-Image: image latents [channels, 1, h, w] packed in 2x2 patches (QwenImagePipeline's
    layout), each sample's joint attention with its real text tokens (no padding), the model's
    time input sigma itself (the pipeline passes t / 1000)."""

    def check_data(self, dataset) -> None:
        c, root = self.cfg.model, self.cfg.data.root
        channels, width = dataset.meta["latent_channels"], dataset.meta["text_dim"]
        if channels * c.patch_size**2 != c.in_channels or width != c.joint_attention_dim:
            raise UserError(
                f"{root}: latents of {channels} channels (x {c.patch_size}^2 packed) and text states of width {width}, "
                f"but model.in_channels={c.in_channels} and model.joint_attention_dim={c.joint_attention_dim}"
            )
        shapes = dataset.shapes() if hasattr(dataset, "shapes") else []
        bad = next((i for i, (_, f, h, w) in enumerate(shapes) if f != 1 or h % c.patch_size or w % c.patch_size), None)
        if bad is not None:
            raise UserError(
                f"{root}: sample {bad} has latents {tuple(shapes[bad])}; Qwen-Image trains on images (1 frame) whose latent sides "
                f"divide by model.patch_size={c.patch_size}"
            )

    def token_counts(self, latents: list[torch.Tensor]) -> list[int]:
        """Each image's packed-token count: QwenImagePipeline's `image_seq_len`."""
        p = self.cfg.model.patch_size
        return [(x.shape[2] // p) * (x.shape[3] // p) for x in latents]

    def predict_rows(self, model, inputs, targets, sigma, texts, cond, images=None):
        from loongforge.diffusion.models.qwen_image import JointPack, pack_latents

        p = self.cfg.model.patch_size
        shapes = [(1, x.shape[2] // p, x.shape[3] // p) for x in inputs]
        pack = JointPack.of(shapes, [len(t) for t in texts], self.device)
        pred = model(torch.cat([pack_latents(x, p) for x in inputs]), torch.cat(texts).to(self.device), sigma, pack, self.cp_group)
        target = torch.cat([pack_latents(x, p) for x in targets])
        lens = torch.tensor([f * h * w for f, h, w in shapes], device=self.device)
        start, end = 0, target.shape[0]
        if self.cp_group is not None:  # this rank's image tokens
            start, end = local_range(end, dist.get_rank(self.cp_group), dist.get_world_size(self.cp_group))
        return pred, target[start:end], pack.img_sample[start:end], lens, None
