"""The `diffusion.wan` and `diffusion.qwen_image` recipes: a Wan video transformer or a
Qwen-Image MMDiT trained by flow matching on preprocessed latents, with core's trainer on the
torch-native stack (DDP, ZeRO-1, FSDP2, HSDP; Ulysses context parallelism) or the megatron
stack (tensor, Ulysses context and data parallelism). The two families differ in their checks, the data's
family (the frozen encoders) and the task; the run is the same."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from loongforge.core.accelerator import get_accelerator
from loongforge.core.checkpoint.layout import write_durable
from loongforge.core.errors import UserError
from loongforge.core.ops import OpTable
from loongforge.core.registry import registry
from loongforge.core.stacks.build import build_stack
from loongforge.core.train.precision import resolve_params_dtype
from loongforge.core.train.run_dir import prepare_run_dir, run_identity, start_run_dir
from loongforge.core.train.trainer import Trainer

EMPTY_TEXT = "empty_text.safetensors"  # the empty prompt's text states: caption dropout and guidance
FROZEN = "frozen.json"  # what generation loads: {"vae": dir, "text_encoder": dir, and I2V's "image_encoder": dir}


def latent_root(cfg, run_dir: Path) -> Path:
    return run_dir / "data" / "demo" / "latents" if cfg.data.root == "demo" else Path(cfg.data.root)


def family(cfg) -> str:
    return "qwen_image" if cfg.recipe in ("diffusion.qwen_image", "qwen_image") else "wan"


def image_to_video(cfg) -> bool:
    """Wan2.1 image-to-video: the transformer takes CLIP image features (model.image_dim)."""
    return getattr(cfg.model, "image_dim", None) is not None


def identity_frozen(cfg) -> dict:
    """The frozen section as the run's identity reads it: text-to-video runs without the image
    encoder's key, so their identity is what it was before image-to-video."""
    frozen = dataclasses.asdict(cfg.frozen)
    if frozen.get("image_encoder") is None:
        frozen.pop("image_encoder", None)
    return frozen


def validate(cfg) -> None:
    validate_parallel(cfg)
    if family(cfg) == "qwen_image":
        validate_qwen_image(cfg)
    else:
        validate_wan(cfg)
    cfg.flow.validate()
    if cfg.data.root != "demo" and not (Path(cfg.data.root) / "meta.json").is_file():
        raise UserError(f"data.root={cfg.data.root}: not a preprocessed latent directory (run `loongforge-diffusion preprocess` first)")
    load = cfg.checkpoint.load
    if load:
        from loongforge.diffusion.model_io import transformer_dir

        if not (transformer_dir(Path(load)) / "config.json").is_file() and cfg.boundary_ratio is None:
            raise UserError(f"checkpoint.load={load}: expected a diffusers transformer directory (config.json + weights)")


def validate_parallel(cfg) -> None:
    """Both stacks: data and Ulysses context parallelism (which splits the attention heads over
    the CP group); the megatron stack also tensor parallelism (the heads and the MLPs' hidden
    units split over the TP group, then each TP rank's heads over the CP group)."""
    par, m = cfg.parallel, cfg.model
    cp, heads = par.context_parallel_size, m.num_attention_heads
    if cp > 1 and heads % cp:
        raise UserError(f"parallel.context_parallel_size={cp} must divide model.num_attention_heads={heads}")
    if par.stack != "megatron":
        return
    for what, value, ok in (
        ("pipeline_model_parallel_size", par.pipeline_model_parallel_size, 1),
        ("expert_model_parallel_size", par.expert_model_parallel_size, 1),
        ("sequence_parallel", par.sequence_parallel, False),
        ("data_parallel_mode", par.data_parallel_mode, "ddp"),
        ("compile", par.compile, False),
    ):
        if value != ok:
            raise UserError(
                f"parallel.{what}={value}: diffusion models on the megatron stack have tensor, context and data parallelism only; "
                f"set it to {ok} (FSDP and compile: parallel.stack=torch)"
            )
    tp = par.tensor_model_parallel_size
    if heads % (tp * cp):
        raise UserError(
            f"parallel.tensor_model_parallel_size={tp} x parallel.context_parallel_size={cp} must divide model.num_attention_heads={heads}"
        )
    if getattr(m, "ffn_dim", 0) % tp:  # Wan's (Qwen-Image's MLPs are 4 x hidden)
        raise UserError(f"parallel.tensor_model_parallel_size={tp} must divide model.ffn_dim={m.ffn_dim}")


def validate_qwen_image(cfg) -> None:
    cfg.model.check()
    for what, value, default in (
        ("boundary_ratio", cfg.boundary_ratio, None),
        ("flow.first_frame_condition", cfg.flow.first_frame_condition, 0.0),
        ("frozen.image_encoder", cfg.frozen.image_encoder, None),
    ):
        if value != default:
            raise UserError(f"{what}={value}: not supported for Qwen-Image; set it to {default}")


def validate_wan(cfg) -> None:
    cfg.model.check()
    if image_to_video(cfg):
        validate_i2v(cfg)
    elif cfg.frozen.image_encoder is not None:
        raise UserError(
            f"frozen.image_encoder={cfg.frozen.image_encoder}: only an image-to-video model (model.image_dim) takes one; set it to null"
        )
    if cfg.boundary_ratio is not None:
        if not 0 < cfg.boundary_ratio < 1:
            raise UserError(
                f"boundary_ratio={cfg.boundary_ratio} must be in (0, 1) (Wan2.2 A14B text-to-video: 0.875), or null for one transformer"
            )
        if cfg.flow.first_frame_condition > 0:
            raise UserError(
                "boundary_ratio (two experts) with flow.first_frame_condition > 0 is not supported (A14B routes by each sample's time)"
            )
    if cfg.data.text_len < 1:
        raise UserError(f"data.text_len={cfg.data.text_len} must be at least 1 (Wan: 512)")


def validate_i2v(cfg) -> None:
    """Wan2.1 image-to-video: an image encoder, and none of the features it is not built with."""
    if cfg.frozen.image_encoder is None:
        raise UserError(
            "model.image_dim (image-to-video) needs frozen.image_encoder: a Wan I2V pipeline / CLIPVisionModel directory, or tiny"
        )
    for what, value, default in (
        ("boundary_ratio", cfg.boundary_ratio, None),
        ("flow.first_frame_condition", cfg.flow.first_frame_condition, 0.0),
    ):
        if value != default:
            raise UserError(f"{what}={value}: not supported for image-to-video (model.image_dim); set it to {default}")
    if cfg.data.text_len != 512:  # diffusers' WanTransformer3DModel splits the image features off a 512-token text
        raise UserError(
            f"data.text_len={cfg.data.text_len}: image-to-video (model.image_dim) trains on Wan's 512 text tokens; set it to 512"
        )


def prepare_data(cfg, run_dir: Path) -> None:
    """Rank 0, before training: the demo set (generated, then preprocessed), the frozen encoders'
    record (tiny ones written into the run) and the empty prompt's text states."""
    from loongforge.diffusion.data import encode_text, load_text_encoder, preprocess, save_frozen, write_demo_videos

    fam = family(cfg)
    if cfg.data.root == "demo":
        d = cfg.data.demo
        raw = write_demo_videos(
            run_dir / "data" / "demo" / "raw", count=d.count, frames=d.frames, height=d.height, width=d.width, seed=cfg.data.seed
        )
        frames = 1 if fam == "qwen_image" else d.frames  # Qwen-Image: each video's first frame
        preprocess(
            raw,
            latent_root(cfg, run_dir),
            vae_spec=cfg.frozen.vae,
            text_spec=cfg.frozen.text_encoder,
            buckets=[f"{d.height}x{d.width}x{frames}"],
            fps=None,
            family=fam,
            image_spec=cfg.frozen.image_encoder if image_to_video(cfg) else None,
        )
    image_spec = cfg.frozen.image_encoder if image_to_video(cfg) else None
    frozen = save_frozen(cfg.frozen.vae, cfg.frozen.text_encoder, run_dir / "frozen", family=fam, image_spec=image_spec)
    write_durable(run_dir / FROZEN, json.dumps(frozen, indent=1))
    if not (run_dir / EMPTY_TEXT).is_file():
        from safetensors.torch import save_file

        tok, enc = load_text_encoder(frozen["text_encoder"], family=fam)
        tmp = run_dir / f".{EMPTY_TEXT}.tmp"
        save_file({"text": encode_text(tok, enc, [""], family=fam)[0].contiguous()}, str(tmp))
        tmp.replace(run_dir / EMPTY_TEXT)


def run(cfg) -> dict:
    from loongforge.diffusion.data import LatentDataset
    from loongforge.diffusion.task import QwenImageTask, WanTask
    from safetensors.torch import load_file

    validate(cfg)
    acc = get_accelerator()
    params_dtype = resolve_params_dtype(cfg.train.params_dtype, acc)
    stack, ctx = build_stack(cfg.parallel, cfg.train, acc, params_dtype, context_parallel=True)
    ops = OpTable.build(cfg.ops, registry(), acc.device_type)
    run_dir = Path(cfg.checkpoint.run_dir)
    identity = run_identity(
        cfg.train,
        model=cfg.model,
        boundary_ratio=cfg.boundary_ratio,
        flow=cfg.flow,
        data=cfg.data,
        frozen=identity_frozen(cfg),
        load=cfg.checkpoint.load,
    )
    start = prepare_run_dir(cfg.checkpoint, identity)
    start_run_dir(cfg.checkpoint, start, identity, lambda d: prepare_data(cfg, d))
    dataset = LatentDataset(latent_root(cfg, run_dir))
    empty = load_file(str(run_dir / EMPTY_TEXT))["text"]
    load = Path(cfg.checkpoint.load) if cfg.checkpoint.load else None
    task_cls = QwenImageTask if family(cfg) == "qwen_image" else WanTask
    # the megatron stack: the model splits over the TP group and recomputes its own blocks
    tp_group = ctx.tp_group if ctx is not None and ctx.tp_size > 1 else None
    recompute = ctx is not None and cfg.train.recompute
    task = task_cls(cfg, dataset, empty, stack.data_rank, stack.data_size, acc.device(), ops, load, stack.cp_group, tp_group, recompute)
    trainer = Trainer(cfg.train, cfg.checkpoint, stack, acc, task, dataclasses.asdict(cfg), identity, ops)
    return trainer.run(start.resume_from, verified=True)
