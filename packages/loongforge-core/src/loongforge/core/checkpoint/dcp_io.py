"""Model + optimizer shards through torch.distributed.checkpoint (the torch stack).

Keys are parameter names (`get_model_state_dict` / `get_optimizer_state_dict`, the optimizer
state flattened per parameter: `state.<name>.exp_avg`, `param_groups.<name>.lr`), so a
checkpoint does not depend on how the parameters were laid out when it was written: DCP reshards
DTensor shards (FSDP, HSDP) and whole tensors (DDP, or ZeRO-1, where each rank holds the
optimizer state of its own share) into whatever the loading model and optimizer hold.
Floating-point tensors are written in fp32 whatever the run's precision, so the format does not
depend on it either (a bf16 tensor loads through an fp32 copy).

`select(name) -> bool` limits the model tensors written or read, and the optimizer state of
those parameters, to the named ones (LoRA checkpoints hold only the adapters)."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from loongforge.core.checkpoint.megatron_io import Select
from loongforge.core.errors import UserError

_OPTIONS = dict(flatten_optimizer_state_dict=True)


def _param_name(key: str, names: set[str]) -> str | None:
    """The parameter a flattened optimizer key (`state.<name>.<field>[.<more>]`,
    `param_groups.<name>.<field>`) belongs to."""
    rest = key.split(".", 1)[1]
    parts = rest.split(".")
    for i in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:i])
        if name in names:
            return name
    return None


def init_optimizer_state(optimizer) -> None:
    """Give every parameter AdamW state (`step` on the parameter's device, as TableAdamW keeps
    it), so a save writes every name and a load has tensors to fill."""
    from loongforge.core.train.optimizer import init_adamw_state

    for group in optimizer.param_groups:
        for p in group["params"]:
            if not optimizer.state[p]:
                init_adamw_state(optimizer.state[p], p, getattr(optimizer, "ema_decay", 0.0))


def _state_dicts(model, optimizer, select: Select) -> tuple[dict, dict, dict]:
    """(this rank's model state dict, flattened optimizer state dict, the part of both that
    `select` keeps as {"model": ..., "optimizer": ...}); tensors share storage with the model
    and optimizer."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(**_OPTIONS)
    model_sd = get_model_state_dict(model, options=options)
    optim_sd = {}
    if optimizer is not None:
        init_optimizer_state(optimizer)  # every parameter has state to write, and to load into
        optim_sd = get_optimizer_state_dict(model, optimizer, options=options)
    if select is None:
        return model_sd, optim_sd, {"model": dict(model_sd), "optimizer": dict(optim_sd)}
    names = set(model_sd)
    chosen = {
        "model": {k: v for k, v in model_sd.items() if select(k)},
        "optimizer": {k: v for k, v in optim_sd.items() if (n := _param_name(k, names)) is None or select(n)},
    }
    return model_sd, optim_sd, chosen


def _needs_fp32(v) -> bool:
    return torch.is_tensor(v) and v.is_floating_point() and v.dtype != torch.float32


def save_dcp(directory: Path, model, optimizer=None, select: Select = None) -> None:
    """Write the model (and optimizer) into `directory` (every rank calls it; DCP writes each
    replicated tensor once)."""
    import torch.distributed.checkpoint as dcp

    _, _, chosen = _state_dicts(model, optimizer, select)
    for part in chosen.values():
        for k, v in part.items():
            if _needs_fp32(v):
                part[k] = v.float()
    dcp.save(chosen, checkpoint_id=str(directory))


def load_dcp(directory: Path, model, optimizer=None, optimizer_steps: int = 0, select: Select = None) -> None:
    """Read what `save_dcp` wrote, at any layout, into the model (and optimizer), in place; a
    selected name missing from the checkpoint is an error. Every parameter's AdamW `step` is set
    to `optimizer_steps`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    model_sd, optim_sd, chosen = _state_dicts(model, optimizer, select)
    for part in chosen.values():
        for k, v in part.items():
            if _needs_fp32(v):
                part[k] = torch.empty_like(v, dtype=torch.float32)
    dcp.load(chosen, checkpoint_id=str(directory))
    # tensors of the model's own dtype were filled in place; the rest (fp32 copies) go in here
    set_model_state_dict(model, chosen["model"], options=StateDictOptions(strict=False, **_OPTIONS))
    if optimizer is not None:
        optim_sd.update(chosen["optimizer"])
        for k, v in optim_sd.items():
            if k.startswith("state.") and k.endswith(".step"):
                optim_sd[k] = torch.full_like(v, float(optimizer_steps)) if torch.is_tensor(v) else float(optimizer_steps)
        set_optimizer_state_dict(model, optimizer, optim_sd, options=StateDictOptions(**_OPTIONS))


def read_model_state(directory: Path, ema: bool = False) -> dict[str, torch.Tensor]:
    """The whole model state of a `save_dcp` checkpoint, or of a megatron-stack checkpoint of a
    plain torch model (megatron-core's torch_dist format is DCP too, its keys unprefixed), as
    plain CPU tensors keyed like `model.state_dict()`, read by this process alone (no model, no
    process group needed; collective-free even where one exists): for an HF export from any
    layout. `ema`: each parameter the optimizer kept an EMA of (`train.ema_decay`) comes as that
    EMA, in the model's dtype; an error if the checkpoint holds none."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    if (Path(directory) / "metadata.json").is_file():  # megatron-core's: model tensors by name, optimizer.state.<state>.<name>
        names = {k: k for k in meta if not k.startswith("optimizer.")}
        ema_key = "optimizer.state.ema.{}"
    else:
        names = {k: k.removeprefix("model.") for k in meta if k.startswith("model.")}
        ema_key = "optimizer.state.{}.ema"
    names = {k: n for k, n in names.items() if isinstance(meta[k], TensorStorageMetadata)}
    model = {n: torch.empty(meta[k].size, dtype=meta[k].properties.dtype) for k, n in names.items()}
    emas = {}
    if ema:
        emas = {
            ema_key.format(n): torch.empty(meta[key].size, dtype=meta[key].properties.dtype)
            for n in model
            if (key := ema_key.format(n)) in meta and isinstance(meta[key], TensorStorageMetadata)
        }
        if not emas:
            raise UserError(f"{directory}: the checkpoint holds no EMA weights (it was trained with train.ema_decay=0)")
    with warnings.catch_warnings():  # DCP notes that it loads in one process, which is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({**{k: model[n] for k, n in names.items()}, **emas}, checkpoint_id=str(directory), no_dist=True)
    for n in model:
        if ema_key.format(n) in emas:
            model[n] = emas[ema_key.format(n)].to(model[n].dtype)
    return model


def read_run(run_dir: Path, config_cls, recipe: str, ema: bool | None = None, what: str = "read"):
    """(the run's config as `config_cls`, its newest checkpoint's whole model state) of a finished
    or running run of `recipe` (a plain torch model, either stack), for inference and export. `ema`: the EMA of the weights
    (`train.ema_decay`) or the trained weights; None: the EMA where the run kept one. `what` names
    the action in errors ("serve", "export", ...)."""
    from loongforge.core.checkpoint.layout import find_checkpoint, read_manifest, verify_files
    from omegaconf import OmegaConf

    step = find_checkpoint(run_dir)
    if step is None:
        raise UserError(f"{run_dir}: no checkpoint to {what} (train first, or name the run directory)")
    verify_files(step)
    manifest = read_manifest(step)
    if manifest["config"].get("recipe") != recipe:
        raise UserError(f"{run_dir}: a {manifest['config'].get('recipe')} run, not a {recipe} run")
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(config_cls), manifest["config"]))
    if ema and not cfg.train.ema_decay > 0:
        raise UserError(f"{run_dir}: the run kept no EMA of its weights (train.ema_decay=0); use the trained weights")
    return cfg, read_model_state(step, ema=cfg.train.ema_decay > 0 if ema is None else ema)
