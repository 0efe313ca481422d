"""Diffusion transformers in and out of diffusers' format, and the Python API.

    from loongforge.diffusion import load_model
    model = load_model("Wan2.1-T2V-1.3B-Diffusers/transformer")   # or a run directory of ours
    noise_pred = model(hidden_states=latents, timestep=t, encoder_hidden_states=text_states)

A diffusers transformer directory is `config.json` plus `diffusion_pytorch_model.safetensors`
(or its sharded index), as `save_pretrained` writes it; its `_class_name` names the family
(`WanTransformer3DModel`, `QwenImageTransformer2DModel`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from loongforge.core.errors import UserError
from loongforge.core.foundation.hf_mapping import hf_to_lf, lf_to_hf
from loongforge.diffusion.models import qwen_image
from loongforge.diffusion.models.wan import WAN_TABLE, WanConfig, WanDiT, predict
from torch import nn

WEIGHTS = "diffusion_pytorch_model.safetensors"


class DiffusersCall(nn.Module):
    """A Wan transformer called with diffusers' forward arguments; returns the prediction tensor."""

    def __init__(self, model: WanDiT):
        super().__init__()
        self.model = model

    def forward(
        self, hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image=None, return_dict=None, attention_kwargs=None
    ):
        return predict(self.model, hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image)


class QwenImageCall(nn.Module):
    """A Qwen-Image transformer called with diffusers' forward arguments; returns the prediction."""

    def __init__(self, model: qwen_image.QwenImageDiT):
        super().__init__()
        self.model = model

    def forward(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask=None, timestep=None, img_shapes=None, **unused):
        extra = sorted(k for k, v in unused.items() if v is not None and k not in ("return_dict", "attention_kwargs"))
        if extra:
            raise ValueError(f"Qwen-Image here does not take {extra[0]!r}")
        return qwen_image.predict(self.model, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, timestep, img_shapes)


# diffusers class name -> (config class, mapping table, model class, diffusers-argument wrapper)
FAMILIES = {
    "WanTransformer3DModel": (WanConfig, WAN_TABLE, WanDiT, DiffusersCall),
    "QwenImageTransformer2DModel": (qwen_image.QwenImageConfig, qwen_image.QWEN_IMAGE_TABLE, qwen_image.QwenImageDiT, QwenImageCall),
}


def family_of(cfg) -> tuple:
    return next(f for f in FAMILIES.values() if isinstance(cfg, f[0]))


def transformer_dir(path: Path) -> Path:
    """`path` itself or, for a whole pipeline directory, its `transformer/`."""
    path = Path(path)
    if not (path / "config.json").is_file() and (path / "transformer" / "config.json").is_file():
        return path / "transformer"
    return path


def read_diffusers(path: Path) -> tuple:
    """(config, our state dict) of a diffusers transformer directory of a supported family."""
    from safetensors.torch import load_file

    d = transformer_dir(path)
    if not (d / "config.json").is_file():
        raise UserError(f"{path}: not a diffusers transformer directory (no config.json)")
    meta = json.loads((d / "config.json").read_text())
    name = meta.get("_class_name", "WanTransformer3DModel")
    if name not in FAMILIES:
        raise UserError(f"{d}: a {name}; supported diffusers transformers: {', '.join(FAMILIES)}")
    config_cls, table, _, _ = FAMILIES[name]
    cfg = config_cls.from_diffusers(meta)
    index = d / f"{WEIGHTS}.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (d / WEIGHTS).is_file():
        files = [WEIGHTS]
    else:
        raise UserError(f"{d}: no {WEIGHTS} (or its .index.json)")
    state = {}
    for f in files:
        state.update(load_file(str(d / f)))
    return cfg, hf_to_lf(table, state, cfg)


def write_diffusers(cfg, state: dict[str, torch.Tensor], out: Path) -> None:
    """Our state dict -> `out/config.json` + `out/diffusion_pytorch_model.safetensors` (out: an
    existing empty directory; callers write into a temporary one and rename it)."""
    from safetensors.torch import save_file

    tensors = {k: v.contiguous() for k, v in lf_to_hf(family_of(cfg)[1], state, cfg).items()}
    save_file(tensors, str(Path(out) / WEIGHTS), metadata={"format": "pt"})
    (Path(out) / "config.json").write_text(json.dumps(cfg.diffusers_config(), indent=2) + "\n")


EXPERT_DIRS = (("high", "transformer"), ("low", "transformer_2"))  # WanPipeline's names of Wan2.2 A14B's experts


def read_transformers(path: Path, run) -> dict[str, torch.Tensor]:
    """The starting state of a run's transformer(s) from `path`, whose config must be the run's
    model: one transformer directory, or for a two-expert run a pipeline directory holding
    transformer/ (high noise) and transformer_2/ (low noise)."""
    path = Path(path)
    if run.boundary_ratio is None:
        parts = [("", path)]
    else:
        parts = [(f"{ours}.", path / theirs) for ours, theirs in EXPERT_DIRS]
        missing = [str(d) for _, d in parts if not (d / "config.json").is_file()]
        if missing:
            raise UserError(
                f"checkpoint.load={path}: a two-expert run (boundary_ratio) loads a Wan2.2 pipeline directory; {missing[0]} is missing"
            )
    state = {}
    for prefix, d in parts:
        cfg, part = read_diffusers(d)
        if cfg != run.model:
            raise UserError(f"checkpoint.load={d}: its config.json differs from the run's model section; copy its shape into model")
        state.update({prefix + k: v for k, v in part.items()})
    return state


def read_trained(run_dir: Path, ema: bool | None = None, what: str = "read"):
    """(config, model state) of a run of either diffusion recipe (`read_run` of its config class)."""
    from loongforge.core.checkpoint import find_checkpoint, read_manifest
    from loongforge.core.checkpoint.dcp_io import read_run
    from loongforge.diffusion.config import QwenImageRunConfig, WanRunConfig

    step = find_checkpoint(run_dir)
    recipe = read_manifest(step)["config"].get("recipe") if step is not None else None
    if recipe == "diffusion.qwen_image":
        return read_run(run_dir, QwenImageRunConfig, recipe, ema, what=what)
    return read_run(run_dir, WanRunConfig, "diffusion.wan", ema, what=what)


def load_model(path, ema: bool | None = None) -> nn.Module:
    """A diffusers transformer directory of a supported family (WanTransformer3DModel,
    QwenImageTransformer2DModel; or a pipeline directory holding one), or a run directory of
    `loongforge-diffusion train` (its newest checkpoint; `ema` as `generate` takes it; a
    two-expert run routes each call by its time) -> a module called with the diffusers model's
    own forward arguments, returning the prediction tensor (CPU, the weights' dtype)."""
    path = Path(path)
    if (path / "checkpoints").is_dir():
        from loongforge.diffusion.task import build_transformer

        run, state = read_trained(path, ema, what="load")
        model = build_transformer(run)
        call = QwenImageCall if isinstance(model, qwen_image.QwenImageDiT) else DiffusersCall
    else:
        cfg, state = read_diffusers(path)
        _, _, model_cls, call = family_of(cfg)
        model = model_cls(cfg)
    model.load_state_dict(state, strict=True)
    return call(model.to(next(iter(state.values())).dtype)).eval()


def export_run(run_dir, out, ema: bool | None = None) -> Path:
    """A run's newest checkpoint (its EMA where it kept one, unless `ema` says) as a diffusers
    WanTransformer3DModel directory at `out` (new or empty; written whole, then renamed); a
    two-expert run as `out/transformer` and `out/transformer_2`, as a Wan2.2 pipeline holds them."""
    from loongforge.core.outputs import replaced_dir, require_new_dir

    out = require_new_dir(Path(out))
    run, state = read_trained(Path(run_dir), ema, what="export")
    with replaced_dir(out) as tmp:
        if run.boundary_ratio is None:
            write_diffusers(run.model, state, tmp)
        for ours, theirs in EXPERT_DIRS if run.boundary_ratio is not None else ():
            (tmp / theirs).mkdir()
            write_diffusers(run.model, {k.removeprefix(f"{ours}."): v for k, v in state.items() if k.startswith(f"{ours}.")}, tmp / theirs)
    return out
