"""Read and write HF-format checkpoint directories (config.json + safetensors)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from loongforge.core.errors import UserError
from loongforge.core.foundation.spec import FamilySpec, ModelConfig
from loongforge.core.outputs import require_new_dir

SHARD_BYTES = 4 * 1024**3


def is_hf_dir(path) -> bool:
    p = Path(path)
    return (p / "config.json").is_file() and any(p.glob("*.safetensors"))


def read_hf_config(hf_dir, families: dict[str, FamilySpec], section: str | None = None) -> tuple[FamilySpec, ModelConfig]:
    """The family and model config of an HF directory; `section` reads a nested config (e.g. a
    VLM's `text_config`)."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise UserError(f"{hf_dir}: not an HF model directory (no config.json)")
    c = json.loads(path.read_text())
    if section is not None:
        if not isinstance(c.get(section), dict):
            raise UserError(f"{path}: no {section!r} section")
        c = c[section]
    return model_config_from_hf(c, families, hf_dir)


def model_config_from_hf(c: dict, families: dict[str, FamilySpec], hf_dir) -> tuple[FamilySpec, ModelConfig]:
    """The family and model config of an HF config dict (`hf_dir` names it in errors)."""
    by_type = {t: f for f in families.values() for t in (f.hf_model_type, *f.hf_model_type_aliases)}
    mt = c.get("model_type")
    if mt not in by_type:
        raise UserError(f"{hf_dir}: unknown model_type {mt!r}; supported: {', '.join(sorted(by_type))}")
    fam = by_type[mt]
    rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    theta = c.get("rope_theta", rope.pop("rope_theta", 10000.0))
    rope.pop("rope_theta", None)
    partial = rope.pop("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    mrope = rope.pop("mrope_section", None)
    interleaved = bool(rope.pop("mrope_interleaved", False))
    # (configs before transformers 5 call M-RoPE's plain rotary angles rope_type "mrope")
    scaling = rope if rope.get("rope_type", rope.get("type", "default")) not in ("default", "mrope") else None
    heads = c["num_attention_heads"]
    check_hf_keys(c, fam, hf_dir)
    fields = dict(
        family=fam.name,
        num_layers=c["num_hidden_layers"],
        hidden_size=c["hidden_size"],
        num_attention_heads=heads,
        num_query_groups=c.get("num_key_value_heads") or heads,
        ffn_hidden_size=c["intermediate_size"],
        vocab_size=c["vocab_size"],
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        max_position_embeddings=c.get("max_position_embeddings", 2048),
        rope_theta=float(theta),
        rope_scaling=scaling,
        rotary_percent=float(partial),
        mrope_section=list(mrope) if mrope else None,
        mrope_interleaved=interleaved,
        norm_eps=c.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        qkv_bias=bool(c.get(fam.hf_qkv_bias_key, fam.qkv_bias)) if fam.hf_qkv_bias_key else fam.qkv_bias,
        qk_norm=fam.qk_norm,
        init_std=c.get("initializer_range", 0.02),
    )
    fields.update({row[1]: _hf_value(row, c[k], "read") for row in fam.hf_fields for k in reversed(row[0].split("|")) if k in c})
    return fam, ModelConfig(**fields)


def _hf_value(row: tuple, value, direction: str):
    """A family's `hf_fields` row maps a value as it is, or with its (read, write) functions."""
    if len(row) == 2:
        return value
    return row[2](value) if direction == "read" else row[3](value)


# the keys `read_hf_config` reads for every family
COMMON_HF_KEYS = (
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "head_dim",
    "max_position_embeddings",
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "partial_rotary_factor",
    "rms_norm_eps",
    "tie_word_embeddings",
    "initializer_range",
)


def check_hf_keys(c: dict, fam: FamilySpec, hf_dir) -> None:
    """For a family with `hf_other_keys`: every key of the HF config is one LoongForge reads or
    knows to be harmless; a feature it does not implement is named, never silently ignored."""
    if fam.hf_other_keys is None:
        return
    known = set(COMMON_HF_KEYS) | {k for row in fam.hf_fields for k in row[0].split("|")}
    if fam.hf_qkv_bias_key:
        known.add(fam.hf_qkv_bias_key)
    required = {}
    for item in fam.hf_other_keys:
        key, value = item if isinstance(item, tuple) else (item, None)
        known.add(key)
        if isinstance(item, tuple):
            required[key] = value
    for key, value in c.items():
        if key not in known:
            raise UserError(f"{hf_dir}: config.json field {key!r} is not implemented for the {fam.name} family (it would be ignored)")
        if key in required and value != required[key] and value is not None:
            raise UserError(f"{hf_dir}: config.json {key}={value!r} is not implemented for the {fam.name} family (only {required[key]!r})")


def hf_config_dict(fam: FamilySpec, cfg: ModelConfig, dtype: torch.dtype, extra: dict | None = None) -> dict:
    rope_params = {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta}
    if cfg.rotary_percent != 1.0:
        rope_params["partial_rotary_factor"] = cfg.rotary_percent
    if cfg.mrope_section:
        rope_params["mrope_section"] = list(cfg.mrope_section)
        if cfg.mrope_interleaved:
            rope_params["mrope_interleaved"] = True
    d = {
        "architectures": [fam.hf_architecture],
        "model_type": fam.hf_model_type,
        "num_hidden_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups,
        "intermediate_size": cfg.ffn_hidden_size,
        "vocab_size": cfg.vocab_size,
        "head_dim": cfg.kv_channels,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "rope_parameters": rope_params,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": "silu",
        "initializer_range": cfg.init_std,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "dtype": str(dtype).removeprefix("torch."),
    }
    if fam.hf_qkv_bias_key:
        d[fam.hf_qkv_bias_key] = bool(cfg.qkv_bias)
    d.update({row[0].split("|")[0]: _hf_value(row, getattr(cfg, row[1]), "write") for row in fam.hf_fields})
    return {**d, **dict(fam.hf_extra_config), **(extra or {})}


def load_hf_state(hf_dir) -> dict:
    from safetensors import safe_open

    files = sorted(Path(hf_dir).glob("*.safetensors"))
    if not files:
        raise UserError(f"{hf_dir}: no *.safetensors weights found")
    state = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                for k in fh.keys():
                    state[k] = fh.get_tensor(k)
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise UserError(f"{f}: cannot read safetensors file ({e})") from None
    return state


def _write_new_dir(out_dir, write) -> None:
    """Run `write(tmp)` in a temporary sibling of `out_dir`, then rename it into place; never
    touches an existing non-empty directory."""
    out = require_new_dir(out_dir)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=False)
    write(tmp)
    if out.exists():
        out.rmdir()
    tmp.rename(out)


def save_hf(out_dir, fam: FamilySpec, cfg: ModelConfig, hf_state: dict, dtype=torch.float32, extra_config: dict | None = None) -> None:
    """Write config.json and safetensors shards (with an index when more than one) into a fresh
    directory; files land in a temporary sibling first, then the directory is renamed into place."""
    save_hf_dir(out_dir, hf_config_dict(fam, cfg, dtype, extra_config), hf_state, dtype)


def save_hf_dir(out_dir, config: dict, hf_state: dict, dtype=torch.float32) -> None:
    """`save_hf` with the config.json contents given (composite models write their own)."""
    from safetensors.torch import save_file

    def write(tmp: Path):
        shards, cur, size = [], {}, 0
        for k, v in hf_state.items():
            v = v.to(dtype).contiguous()
            if cur and size + v.numel() * v.element_size() > SHARD_BYTES:
                shards.append(cur)
                cur, size = {}, 0
            cur[k] = v
            size += v.numel() * v.element_size()
        shards.append(cur)
        weight_map = {}
        for n, shard in enumerate(shards):
            name = "model.safetensors" if len(shards) == 1 else f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
        if len(shards) > 1:
            total = sum(v.numel() * v.element_size() for s in shards for v in s.values())
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
            )
        (tmp / "config.json").write_text(json.dumps(config, indent=2))

    _write_new_dir(out_dir, write)


def save_peft(
    out_dir,
    lora,
    tensors: dict,
    modules: list[str],
    num_layers: int,
    base_model_name_or_path: str | None = None,
    *,
    layers_prefix: str = "model.layers.",
    short_names: bool = True,
    modules_to_save: list[str] | None = None,
) -> None:
    """A PEFT LoRA adapter directory: `peft.PeftModel.from_pretrained(base, out_dir)` loads it.
    `modules` are the adapters' module paths in the transformers model, each under
    `layers_prefix` + the layer index. `target_modules` is the list of the linears' own names
    (q_proj, ...) when every layer carries the same ones and `short_names` (no other module of the
    base model has those names), a regex over the layers when every layer carries the same ones,
    else a regex naming exactly the modules that have adapters. `modules_to_save`: modules trained
    whole beside the adapters (`peft_modules_to_save`); their tensors are in `tensors` under
    `base_model.model.<name>`."""
    import re

    from safetensors.torch import save_file

    if not all(m.startswith(layers_prefix) for m in modules):
        raise ValueError(f"adapter modules outside {layers_prefix!r}: {[m for m in modules if not m.startswith(layers_prefix)][:3]}")
    per_layer = {m.removeprefix(layers_prefix).split(".", 1)[1] for m in modules}  # e.g. self_attn.q_proj
    every = {f"{layers_prefix}{i}.{p}" for i in range(num_layers) for p in per_layer}
    if set(modules) == every and short_names:
        target = sorted(p.rsplit(".", 1)[1] for p in per_layer)
    elif set(modules) == every:
        target = re.escape(layers_prefix) + r"\d+\.(" + "|".join(re.escape(p) for p in sorted(per_layer)) + ")"
    else:
        target = "^(" + "|".join(re.escape(m) for m in sorted(modules)) + ")$"
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "use_rslora": lora.rslora,
        "target_modules": target,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": sorted(modules_to_save) if modules_to_save else None,
    }

    def write(tmp: Path):
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))

    _write_new_dir(out_dir, write)


def transformers_names(config: dict) -> dict[str, str]:
    """HF checkpoint tensor names (as transformers' `save_pretrained` writes them) -> the tensors'
    paths in the transformers model of `config` (a config.json's contents; its class built on the
    meta device), which is how PEFT names modules. transformers' own renames decide (Qwen2.5-VL's
    checkpoints say `model.layers.` and `visual.` for its `model.language_model.layers.` and
    `model.visual.`); tensors made by a conversion other than a rename are left out."""
    import transformers

    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        raise UserError(
            f"mapping {config['architectures'][0]}'s names needs transformers 5 (installed: {transformers.__version__})"
        ) from None
    cls = getattr(transformers, config["architectures"][0])
    with torch.device("meta"):
        model = cls._from_config(cls.config_class.from_dict(config))
    state = {k: v.detach() for k, v in model.state_dict().items()}  # one object per name (tied ones too)
    path = {id(v): k for k, v in state.items()}
    return {k: path[id(v)] for k, v in revert_weight_conversion(model, dict(state)).items() if id(v) in path}


def peft_modules_to_save(trained, names) -> list[str]:
    """The fewest modules whose tensors are exactly `trained`, for PEFT's `modules_to_save`:
    `names` are every tensor name of the transformers model (module paths), `trained` those
    trained whole. Each module chosen holds trained tensors only; a container whose children are
    numbered (a ModuleList, which PEFT cannot stand in for) is never chosen, its children are."""
    trained, names = set(trained), set(names)
    if not trained <= names:
        raise ValueError(f"trained tensors the model does not have: {sorted(trained - names)[:3]}")
    under: dict[str, set] = {}  # module -> the tensor names in it
    for n in names:
        parts = n.split(".")
        for i in range(1, len(parts)):
            under.setdefault(".".join(parts[:i]), set()).add(n)

    def numbered(mod: str) -> bool:
        return all(n[len(mod) + 1 :].split(".", 1)[0].isdigit() for n in under[mod])

    out = set()
    for n in sorted(trained):
        parts = n.split(".")
        for i in range(1, len(parts)):
            mod = ".".join(parts[:i])
            if under[mod] <= trained and not numbered(mod):
                out.add(mod)
                break
        else:
            raise ValueError(f"trained tensor {n} is in no module that holds only trained tensors")
    return sorted(out)


def export_peft(ckpt, out_dir, save, base=None, other: str = "") -> Path:
    """What every package's `lf_to_peft` does around its model: the checkpoint's step (`ckpt` a
    run, checkpoints or step directory), refused in one line when it was trained without LoRA
    (before `out_dir` is touched; `other` says what to do instead), then
    `save(step, out_dir, base_model_name_or_path)` writes the adapter directory, recording `base`
    or else the run's `checkpoint.load` as the base model, and the run's tokenizer goes beside it."""
    from loongforge.core.checkpoint import find_checkpoint, read_manifest
    from loongforge.core.data.text import copy_tokenizer, tokenizer_dir_for
    from loongforge.core.foundation.lora import lora_from_manifest

    step = find_checkpoint(ckpt)
    if step is None:
        raise UserError(f"{ckpt}: not a LoongForge checkpoint (no manifest.json or latest)")
    out = require_new_dir(out_dir)
    manifest = read_manifest(step)
    if lora_from_manifest(manifest) is None:
        raise UserError(f"{step} has no LoRA adapters (trained with lora.rank=0){'; ' + other if other else ''}")
    save(step, out, base or manifest["config"].get("checkpoint", {}).get("load"))
    tok = tokenizer_dir_for(step)
    if tok is not None:
        copy_tokenizer(tok, out)
    return out
