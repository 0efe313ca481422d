"""The `vlm.sft` recipe: conversations with images and videos, encoded once (the family's image
processing, chat template, M-RoPE positions), packed into THD rows of `data.seq_length` tokens,
trained on the megatron stack (the language model at any TP/PP; the vision tower on the first
stage, each rank of a TP group encoding its share of a pack's images) by core's trainer, with HF
Qwen2.5-VL in and out."""

from __future__ import annotations

import dataclasses
import itertools
import random
from pathlib import Path

import torch
import torch.distributed as dist
from loongforge.core.accelerator import get_accelerator, to_device
from loongforge.core.checkpoint import find_checkpoint, read_manifest, verify_files
from loongforge.core.data import balanced_rank_samples, best_fit_decreasing, packing_efficiency, rank_micro_batches
from loongforge.core.data.text import copy_tokenizer, load_tokenizer, resolve_tokenizer_path
from loongforge.core.errors import UserError
from loongforge.core.foundation import hf_io
from loongforge.core.foundation.hf_mapping import hf_to_lf
from loongforge.core.foundation.lora import is_adapter_key
from loongforge.core.ops import OpTable
from loongforge.core.outputs import replaced_dir
from loongforge.core.parallel import on_rank0
from loongforge.core.registry import registry
from loongforge.core.stacks.build import build_stack
from loongforge.core.train.precision import resolve_params_dtype
from loongforge.core.train.run_dir import prepare_run_dir, run_identity, start_run_dir
from loongforge.core.train.task import TrainingTask
from loongforge.core.train.trainer import Trainer
from loongforge.vlm.model import VisionLanguageModel, VLMConfig, read_hf_config, vision_index, vlm_arch, vlm_config_from_dict, vlm_table
from loongforge.vlm.model_io import families

VISION_INPUTS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "image_sizes", "batch_num_images")
HOST_INPUTS = ("image_grid_thw", "video_grid_thw", "image_sizes", "batch_num_images")  # sizes the model reads on the host


def tokenizer_path(name: str) -> str:
    """`tiny`: the shipped demo tokenizer with the Qwen2-VL vision tokens; `tiny_llava`: the one
    with LLaVA-OneVision's `<image>` and template; else an HF directory."""
    from loongforge.vlm.data import TINY_LLAVA_TOKENIZER, TINY_TOKENIZER

    return str({"tiny": TINY_TOKENIZER, "tiny_llava": TINY_LLAVA_TOKENIZER}.get(name, name))


def token_ids(tok, arch: str) -> dict:
    """The vision token ids of a tokenizer under an architecture (a UserError naming a missing one)."""
    from loongforge.vlm.data.encode import special_token_id

    return {key: special_token_id(tok, text) for key, text in vlm_arch(arch).tokens}


def resolve_model(cfg, tok) -> tuple[VLMConfig, str | None]:
    """The composed model's config and where its weights come from ('hf', 'lf' or None): an HF
    directory or a checkpoint gives the architecture; otherwise the config's `model` section. The
    vision token ids are the tokenizer's."""
    load = cfg.checkpoint.load
    if not load:
        return dataclasses.replace(cfg.model, **token_ids(tok, cfg.model.arch)), None
    if hf_io.is_hf_dir(load):
        _, mcfg = read_hf_config(load, families())
        source = "hf"
    else:
        step = find_checkpoint(load)
        if step is None:
            raise UserError(f"checkpoint.load={load}: neither an HF VLM directory (Qwen2.5-VL, Qwen3-VL) nor a LoongForge checkpoint")
        mcfg, source = vlm_config_from_dict(read_manifest(step)["config"]["model"]), "lf"
    texts = dict(vlm_arch(mcfg.arch).tokens)
    for k, v in token_ids(tok, mcfg.arch).items():
        if getattr(mcfg, k) != v:
            raise UserError(
                f"checkpoint.load={load} has {k}={getattr(mcfg, k)} but the tokenizer's {texts[k]} is {v}; use the model's own tokenizer"
            )
    return mcfg, source


def validate(cfg, mcfg: VLMConfig, tok) -> None:
    par = cfg.parallel
    if par.stack != "megatron":
        raise UserError(f"parallel.stack={par.stack}: VLMs train on the megatron stack; set parallel.stack=megatron")
    if par.sequence_parallel:
        raise UserError("parallel.sequence_parallel=true: the VLM stack runs without sequence parallelism; set it to false")
    if cfg.train.micro_batch_size != 1:
        raise UserError("VLM micro-batches are THD packs of data.seq_length tokens: set train.micro_batch_size=1 (raise data.seq_length)")
    validate_data(cfg, mcfg, tok)
    if mcfg.language.vocab_size % par.tensor_model_parallel_size:
        raise UserError(
            f"model.language.vocab_size={mcfg.language.vocab_size} must be divisible by tensor_model_parallel_size={par.tensor_model_parallel_size}"
        )
    if cfg.data.balance not in ("cost", "contiguous"):
        raise UserError(f"data.balance={cfg.data.balance!r}: choose cost or contiguous")
    for part in ("vision", "projector", "language"):
        if not getattr(cfg.lr_mult, part) >= 0:
            raise UserError(f"lr_mult.{part}={getattr(cfg.lr_mult, part)} must be at least 0")
    if cfg.freeze.vision and cfg.freeze.projector and cfg.freeze.language and not cfg.lora.enabled:
        raise UserError("freeze.vision, freeze.projector and freeze.language are all true: nothing would train")
    cfg.lora.validate()
    if cfg.lora.enabled and not cfg.checkpoint.load:
        raise UserError("lora.rank > 0 trains adapters on frozen weights: set checkpoint.load to the base model")


def validate_data(cfg, mcfg: VLMConfig, tok) -> None:
    """The data section against the model and tokenizer (training and preprocessing)."""
    d = cfg.data
    if len(tok) > mcfg.language.vocab_size:
        raise UserError(
            f"tokenizer has {len(tok)} tokens but model.language.vocab_size is {mcfg.language.vocab_size}; raise it or use a matching tokenizer"
        )
    if d.on_bad_sample not in ("skip", "error"):
        raise UserError(f"data.on_bad_sample={d.on_bad_sample!r}: choose skip or error")
    if d.seq_length > mcfg.language.max_position_embeddings:
        raise UserError(
            f"data.seq_length={d.seq_length} exceeds model.language.max_position_embeddings={mcfg.language.max_position_embeddings}"
        )
    mcfg.check()


# ---- data ---------------------------------------------------------------------------------


def shifted(sample: dict) -> dict:
    """One encoded sample as the trainer wants it: the next token as each position's label, its
    weight 1 where that token is trained on (the last position predicts nothing)."""
    ids, labels = sample["input_ids"], sample["labels"]
    nxt = torch.cat([labels[1:], labels.new_full((1,), -100)])
    weights = (nxt != -100).float()
    return {**sample, "labels": torch.where(nxt == -100, 0, nxt), "loss_weights": weights, "tokens": ids}


def padded(pack: dict, length: int) -> dict:
    """A pack grown to `length` tokens by one more segment of padding (its own attention segment,
    weight 0, positions from 0): pipeline stages exchange activations of a fixed shape."""
    n = pack["tokens"].shape[1]
    pad = length - n
    if pad <= 0:
        return pack
    out = dict(pack)
    for key in ("tokens", "labels", "loss_weights"):
        out[key] = torch.cat([pack[key], pack[key].new_zeros(1, pad)], dim=1)
    out["positions"] = torch.cat([pack["positions"], torch.arange(pad).expand(3, pad).to(pack["positions"].dtype)], dim=1)
    out["cu_seqlens"] = torch.cat([pack["cu_seqlens"], pack["cu_seqlens"].new_tensor([length])])
    return out


def make_pack(samples: list[dict]) -> dict:
    """Samples in one THD row: tokens / labels / loss_weights [1, T], positions [3, T],
    cu_seqlens, and the vision inputs of every sample in order."""
    lens = [len(s["tokens"]) for s in samples]
    pack = {
        "tokens": torch.cat([s["tokens"] for s in samples])[None],
        "labels": torch.cat([s["labels"] for s in samples])[None],
        "loss_weights": torch.cat([s["loss_weights"] for s in samples])[None],
        "positions": torch.cat([s["position_ids"] for s in samples], dim=1),
        "cu_seqlens": torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32),
    }
    for key in VISION_INPUTS:
        parts = [s[key] for s in samples if s.get(key) is not None]
        pack[key] = torch.cat(parts) if parts else None
    return pack


def processor_config(model: VLMConfig, image: dict):
    """The image / video processing of a model (its patch and merge sizes) under a run's
    `data.image` settings (a dict: a manifest's, or the config's as a dict)."""
    from loongforge.vlm.data import VisionProcessorConfig

    v, arch = model.tower, vlm_arch(model.arch)
    keys = ("min_pixels", "max_pixels", "video_fps", "video_min_pixels", "video_max_pixels", "video_max_frames")
    return VisionProcessorConfig(
        patch_size=v.patch_size,
        temporal_patch_size=v.temporal_patch_size,
        merge_size=v.spatial_merge_size,
        image_mean=arch.image_mean,
        image_std=arch.image_std,
        video_timestamps=arch.frames_apart,
        tokens_per_second=float(model.tokens_per_second),
        **{k: image[k] for k in keys if k in image},
    )


def llava_video_frames(image: dict) -> int:
    """LLaVA-OneVision's frames per video under a run's `data.image` settings (the default where a
    run written before the key has none)."""
    from loongforge.vlm.data.llava import LLAVA_OV_VIDEO_FRAMES

    return image.get("video_frames", LLAVA_OV_VIDEO_FRAMES)


def sample_encoder(model: VLMConfig, tok, image: dict, max_length: int):
    """The architecture's sample encoder under a run's `data.image` settings (a dict)."""
    from loongforge.vlm.data import LlavaSampleEncoder, VisionSampleEncoder

    if vlm_arch(model.arch).grids:
        return VisionSampleEncoder(tok, processor_config(model, image), max_length=max_length)
    return LlavaSampleEncoder(tok, model.tower, max_length=max_length, video_frames=llava_video_frames(image))


def processing_identity(model: VLMConfig, image: dict) -> dict:
    """What of the image processing decides a run's samples (a prepacked directory records it;
    LLaVA-OneVision: the tower's config and the frames per video)."""
    if vlm_arch(model.arch).grids:
        return dataclasses.asdict(processor_config(model, image))
    return {"llava_onevision": dataclasses.asdict(model.tower), "video_frames": llava_video_frames(image)}


def sample_sizes(sample: dict, model: VLMConfig) -> list:
    """[tokens, [patches of each vision item]]: what a sample's cost depends on (an item: an image
    or video of patch grids; a LLaVA tile or video frame, which attends within itself)."""
    if not vlm_arch(model.arch).grids:
        tiles = 0 if sample.get("pixel_values") is None else sample["pixel_values"].shape[0]
        videos = sample.get("pixel_values_videos")
        frames = 0 if videos is None else videos.shape[0] * videos.shape[1]
        return [len(sample["tokens"]), [model.tower.tile_side**2] * (tiles + frames)]
    grids = [g for key in ("image_grid_thw", "video_grid_thw") if sample.get(key) is not None for g in sample[key]]
    return [len(sample["tokens"]), [int(g.prod()) for g in grids]]


def pack_all(cfg, samples: list[dict]) -> tuple[list[dict], list, float]:
    """Samples best-fit into `data.seq_length`-token packs: (packs, each pack's samples' sizes,
    packing efficiency)."""
    lengths = [len(s["tokens"]) for s in samples]
    bins = best_fit_decreasing(lengths, cfg.data.seq_length)
    packs = [make_pack([samples[i] for i in b]) for b in bins]
    sizes = [[sample_sizes(samples[i], cfg.model) for i in b] for b in bins]
    return packs, sizes, packing_efficiency(lengths, bins, cfg.data.seq_length)


def encoded_samples(cfg, tok, run_dir: Path) -> tuple[list[dict], dict]:
    """Every sample of `data.paths`, encoded (bad ones counted and skipped, or an error), and the
    bad samples' counts by reason; the demo set is generated under `run_dir/data/demo`."""
    from loongforge.vlm.data import encode_all, read_records, write_demo_dataset

    d = cfg.data
    paths = list(d.paths)
    if paths == ["demo"]:
        demo = run_dir / "data" / "demo"
        if not (demo / "data.json").is_file():
            on_rank0(lambda: write_demo_dataset(demo, samples=d.demo_samples, seed=d.seed))
            if dist.is_initialized():
                dist.barrier()
        paths = [str(demo / "data.json")]
    encoder = sample_encoder(cfg.model, tok, dataclasses.asdict(d.image), d.seq_length)
    samples, bad = encode_all(read_records(paths, d.format, d.media_root), encoder, d.on_bad_sample, progress=True)
    if bad:
        on_rank0(lambda: print("vlm data: skipped " + ", ".join(f"{n} {reason}" for reason, n in sorted(bad.items())), flush=True))
    return [shifted(s) for s in samples], bad


class VLMTask(TrainingTask):
    """Next-token prediction of a composed VLM on THD packs; the loss the weighted sum of the
    trained tokens' cross-entropies (fused with the output projection through the op table)."""

    unit = "tokens"

    def __init__(self, cfg, mcfg: VLMConfig, source, stack, ctx, ops, packs: list[dict], device, run_dir: Path, costs=None):
        self.cfg, self.mcfg, self.source, self.stack, self.ctx, self.ops = cfg, mcfg, source, stack, ctx, ops
        self.packs, self.device, self.run_dir = packs, device, run_dir
        self.costs = costs  # each pack's cost (data.balance=cost)
        self.family = registry().get("family", mcfg.language.family)
        self.lora = cfg.lora if cfg.lora.enabled else None
        self.trainable_only = self.lora is not None
        t = cfg.train
        self.units_per_step = t.global_batch_size * cfg.data.seq_length
        self.flops_per_step = mcfg.language.flops_per_token(cfg.data.seq_length) * self.units_per_step
        self.activation_shape = (cfg.data.seq_length, 1, mcfg.language.hidden_size)

    def build_model(self):
        rc, default = self.cfg.recompute, self.cfg.train.recompute
        model = VisionLanguageModel.build(
            self.family,
            self.mcfg,
            self.ctx,
            self.ops,
            recompute=default if rc.language is None else rc.language,
            lora=self.lora,
            vision_recompute=default if rc.vision is None else rc.vision,
        )
        freeze(model, self.cfg.freeze, self.cfg.lr_mult)
        return model.to(self.device)

    def batches(self, start_step: int):
        t = self.cfg.train
        orders: dict[int, list[int]] = {}

        def order(epoch: int) -> list[int]:
            if epoch not in orders:
                o = list(range(len(self.packs)))
                random.Random(self.cfg.data.seed + epoch).shuffle(o)
                orders[epoch] = o
            return orders[epoch]

        n = len(self.packs)

        def pack_index(k: int) -> int:
            return order(k // n)[k % n]

        rank, size = self.stack.dp_rank, self.stack.dp_size
        for step in itertools.count(start_step):
            if self.cfg.data.balance == "cost" and self.costs is not None:
                mine = balanced_rank_samples(step, t.global_batch_size, rank, size, lambda k: self.costs[pack_index(k)])
            else:
                mine = [k for (k,) in rank_micro_batches(step, t.global_batch_size, 1, rank, size)]
            yield [self.device_pack(self.packs[pack_index(k)]) for k in mine]

    def device_pack(self, pack: dict) -> dict:
        """A pack as the model takes it: on the device without host syncs (pinned copies), the
        vision grids kept on the host (the model reads them as sizes), the longest sample and the
        pad tokens' positions found here rather than on the device."""
        if self.ctx is not None and self.ctx.pp_size > 1:  # fixed-shape activations between stages
            pack = padded(pack, self.cfg.data.seq_length)
        if self.ctx is None or self.ctx.is_first_stage:
            pack = {**pack, **vision_index(self.mcfg, pack["tokens"])}
        out = {k: (v if k in HOST_INPUTS else to_device(v, self.device)) for k, v in pack.items()}
        out["max_seqlen"] = int(torch.diff(pack["cu_seqlens"]).max())
        return out

    def loss(self, model, mb):
        vision = {k: mb[k] for k in (*VISION_INPUTS, "image_index", "video_index") if mb.get(k) is not None}
        out = model(
            mb["tokens"],
            mb["positions"],
            mb["cu_seqlens"],
            labels=mb["labels"],
            loss_weights=mb["loss_weights"],
            max_seqlen=mb.get("max_seqlen"),
            **vision,
        )
        if not model.post_process:
            return out
        return out, mb["loss_weights"].sum(), {}

    def initial_weights(self, model, optimizer, stack) -> int:
        if self.source is None:
            return 0
        src = self.cfg.checkpoint.load
        if self.source == "hf":
            state = hf_to_lf(vlm_table(self.family, model.cfg.arch), hf_io.load_hf_state(src), model.cfg)
            stack.load_full_state_dict(model, state, skip=is_adapter_key)
            return 0
        step = find_checkpoint(src)
        on_rank0(lambda: verify_files(step))
        stack.load(step, model, select=lambda k: not is_adapter_key(k))
        return 0

    def on_saved(self, step_dir: Path, final: bool) -> None:
        exportable = self.family.name == vlm_arch(self.mcfg.arch).family
        if final and self.cfg.checkpoint.export_hf and exportable and dist.get_world_size() == 1:
            from loongforge.vlm.model_io import export_hf

            with replaced_dir(self.run_dir / "hf") as out:
                export_hf(step_dir, out)
            print(f"exported HF model to {self.run_dir / 'hf'}", flush=True)


def model_parts(model: VisionLanguageModel):
    """(part name, parameter) of every parameter: vision, projector (the patch mergers or the
    projector into the language model), language."""
    if model.vision is not None:
        projector = vlm_arch(model.cfg.arch).projector
        for name, p in model.vision.named_parameters():
            yield ("projector" if name.startswith(projector) else "vision"), p
    for p in model.language.parameters():
        yield "language", p


def freeze(model: VisionLanguageModel, frozen, lr_mult) -> None:
    """Take the frozen parts out of training (`freeze.*`); the others train at their `lr_mult`."""
    for part, p in model_parts(model):
        if getattr(frozen, part):
            p.requires_grad_(False)
        elif getattr(lr_mult, part) != 1.0:
            p.lr_scale = float(getattr(lr_mult, part))


def prepare_for_packing(cfg):
    """(the config with its model resolved, the tokenizer): what encoding and packing need, with
    the run's data checks, for `preprocess`."""
    if cfg.data.prepacked:
        raise UserError("data.prepacked is set: preprocess reads data.paths (unset data.prepacked)")
    tok = load_tokenizer(tokenizer_path(cfg.data.tokenizer))
    mcfg, _ = resolve_model(cfg, tok)
    validate_data(cfg, mcfg, tok)
    return dataclasses.replace(cfg, model=mcfg), tok


def run(cfg) -> dict:
    acc = get_accelerator()
    tok = load_tokenizer(tokenizer_path(cfg.data.tokenizer))
    mcfg, source = resolve_model(cfg, tok)
    params_dtype = resolve_params_dtype(cfg.train.params_dtype, acc)
    stack, ctx = build_stack(cfg.parallel, cfg.train, acc, params_dtype)
    validate(cfg, mcfg, tok)
    cfg = dataclasses.replace(cfg, model=mcfg)
    ops = OpTable.build(cfg.ops, registry(), acc.device_type)
    run_dir = Path(cfg.checkpoint.run_dir)
    identity = run_identity(cfg.train, model=mcfg, data=cfg.data, load=cfg.checkpoint.load, freeze=cfg.freeze, lora=cfg.lora)
    start = prepare_run_dir(cfg.checkpoint, identity)

    def copy_tok(d: Path):
        if start.resume_from is None or not (d / "tokenizer").is_dir():
            with replaced_dir(d / "tokenizer") as tmp:
                copy_tokenizer(resolve_tokenizer_path(tokenizer_path(cfg.data.tokenizer)), tmp)

    start_run_dir(cfg.checkpoint, start, identity, copy_tok)
    if cfg.data.prepacked:
        from loongforge.vlm.prepacked import PrepackedVisionPacks

        packs = PrepackedVisionPacks(cfg.data.prepacked, cfg, tok)
        sizes, desc = packs.sizes, f"{packs.meta['samples']} samples from {cfg.data.prepacked}"
        efficiency = packs.meta["packing_efficiency"]
    else:
        samples, _ = encoded_samples(cfg, tok, run_dir)
        packs, sizes, efficiency = pack_all(cfg, samples)
        desc = f"{len(samples)} samples"
    if len(packs) < cfg.train.global_batch_size:
        raise UserError(f"only {len(packs)} packs for train.global_batch_size={cfg.train.global_batch_size}; add data or lower the batch")
    costs = [sum(cfg.data.cost.cost(tokens, patches) for tokens, patches in pack) for pack in sizes]
    on_rank0(
        lambda: print(
            f"vlm data: {desc}, {len(packs)} packs of {cfg.data.seq_length} tokens, packing efficiency {efficiency:.1%}", flush=True
        )
    )
    task = VLMTask(cfg, mcfg, source, stack, ctx, ops, packs, acc.device(), run_dir, costs)
    trainer = Trainer(cfg.train, cfg.checkpoint, stack, acc, task, dataclasses.asdict(cfg), identity, ops)
    return trainer.run(start.resume_from, verified=True)
