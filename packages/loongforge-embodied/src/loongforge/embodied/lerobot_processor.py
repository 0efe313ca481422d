"""LeRobot 0.4's policy processor files for pi0 / pi0.5, written and read without lerobot.

    inputs, outputs = policy_features(cameras, 224, state_dim, action_dim)
    norm_map = {"VISUAL": "IDENTITY", "STATE": "QUANTILES", "ACTION": "QUANTILES"}
    pipelines = pi_processor_files("pi05", inputs, outputs, norm_map, stats_state(normalizer), 1e-8, 48)
    write_processor_files(pipelines, out)     # policy_preprocessor.json, policy_postprocessor.json, ...
    norm = read_processor_normalizer(out)     # the stats back (a Normalizer), or None without the files

LeRobot saves a policy with two `DataProcessorPipeline`s (`DataProcessorPipeline._save_pretrained`,
lerobot 0.4.4): `policy_preprocessor.json` and `policy_postprocessor.json`, each
`{"name", "steps": [{"registry_name", "config"[, "state_file"]}, ...]}` written by
`json.dump(..., indent=2)`, and for each step with a non-empty `state_dict` a safetensors file
`<pipeline>_step_<i>_<registry name>.safetensors` (no metadata). The steps are those of
`make_pi05_pre_post_processors` / `make_pi0_pre_post_processors`:

    pi0.5  rename_observations_processor, to_batch_processor, normalizer_processor,
           pi05_prepare_state_tokenizer_processor_step, tokenizer_processor, device_processor
    pi0    rename_observations_processor, to_batch_processor, pi0_new_line_processor,
           tokenizer_processor, device_processor, normalizer_processor
    post   unnormalizer_processor, device_processor (cpu)

The (un)normalizer's config is `{eps, features: {key: {type, shape}}, norm_map: {feature type:
mode}}` and its state the stats flattened as `<feature>.<stat>` (`observation.state.q01`,
`action.mean`, ...), float32; both steps hold the same stats, as LeRobot gives both the dataset's.
Only the stats the run's normalizer keeps are written (the ones its modes read).

Reading follows `DataProcessorPipeline.from_pretrained` and `_NormalizationMixin.load_state_dict`
(keys split at their last dot, tensors as float32); a feature is normalized when its type's mode
is not IDENTITY and the state has stats for it, as LeRobot does. A malformed file is a one-line
UserError naming the file and the key.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np
from loongforge.core.errors import UserError
from loongforge.embodied.data.normalize import REQUIRED_STATS, Normalizer, NormMode

PREPROCESSOR = "policy_preprocessor"  # lerobot.utils.constants.POLICY_PREPROCESSOR_DEFAULT_NAME
POSTPROCESSOR = "policy_postprocessor"
PALIGEMMA_TOKENIZER = "google/paligemma-3b-pt-224"  # what LeRobot's pi0 / pi0.5 factories name
FEATURE_TYPES = ("STATE", "VISUAL", "ENV", "ACTION", "REWARD", "LANGUAGE")  # lerobot FeatureType
NORMALIZER, UNNORMALIZER = "normalizer_processor", "unnormalizer_processor"


@dataclass
class Pipeline:
    """One pipeline as `_save_pretrained` writes it: its JSON config and its state files."""

    name: str
    steps: list[dict] = field(default_factory=list)
    states: dict[str, dict] = field(default_factory=dict)  # state file name -> {key: tensor}

    @property
    def file_name(self) -> str:
        return re.sub(r"[^a-zA-Z0-9_]", "_", self.name.lower()) + ".json"

    def add(self, registry_name: str, config: dict, state: dict | None = None) -> None:
        entry: dict[str, Any] = {"registry_name": registry_name, "config": config}
        if state:
            prefix = re.sub(r"[^a-zA-Z0-9_]", "_", self.name.lower())
            state_file = f"{prefix}_step_{len(self.steps)}_{registry_name}.safetensors"
            self.states[state_file] = state
            entry["state_file"] = state_file
        self.steps.append(entry)

    def config_text(self) -> str:
        return json.dumps({"name": self.name, "steps": self.steps}, indent=2)


def policy_features(cameras: list[str], image_size: int, state_dim: int, action_dim: int) -> tuple[dict, dict]:
    """(input features, output features) under LeRobot's keys, as the policy's config.json names them."""
    inputs = {c: {"type": "VISUAL", "shape": [3, image_size, image_size]} for c in cameras}
    inputs["observation.state"] = {"type": "STATE", "shape": [state_dim]}
    return inputs, {"action": {"type": "ACTION", "shape": [action_dim]}}


def stats_state(normalizer: Normalizer, rename: Mapping[str, str] | None = None) -> dict:
    """The normalizer's stats as `_NormalizationMixin.state_dict` flattens them: `<feature>.<stat>`
    float32 tensors (`to_tensor`: from_numpy, then to float32), features renamed by `rename`
    (features it does not name are left out when it is given)."""
    import torch

    out = {}
    for feature, stats in normalizer.stats.items():
        key = feature if rename is None else rename.get(feature)
        if key is None:
            continue
        for name, value in stats.items():
            out[f"{key}.{name}"] = torch.from_numpy(np.asarray(value)).to(torch.float32).contiguous()
    return out


def pi_processor_files(
    variant: str,
    input_features: dict,
    output_features: dict,
    norm_map: dict[str, str],
    state: dict,
    eps: float,
    tokenizer_max_length: int,
    device: str = "cuda",
    tokenizer_name: str = PALIGEMMA_TOKENIZER,
) -> list[Pipeline]:
    """The pre- and postprocessor `make_pi05_pre_post_processors` (variant pi05) or
    `make_pi0_pre_post_processors` (pi0) build, with `state` (`stats_state`) as the (un)normalizer's
    stats. `device` is the preprocessor's device step (LeRobot's scripts override it on load)."""
    if variant not in ("pi05", "pi0"):
        raise UserError(f"policy.variant={variant!r}: LeRobot processor files are written for pi05 and pi0")

    def normalizer_config(features: dict) -> dict:
        return {"eps": eps, "features": features, "norm_map": dict(norm_map)}

    tokenizer = {
        "max_length": tokenizer_max_length,
        "task_key": "task",
        "padding_side": "right",
        "padding": "max_length",
        "truncation": True,
        "tokenizer_name": tokenizer_name,
    }
    pre = Pipeline(PREPROCESSOR)
    pre.add("rename_observations_processor", {"rename_map": {}})
    pre.add("to_batch_processor", {})
    normalizer = (NORMALIZER, normalizer_config({**input_features, **output_features}), state)
    if variant == "pi05":
        pre.add(*normalizer)
        pre.add("pi05_prepare_state_tokenizer_processor_step", {})  # its get_config is the base's {}
        pre.add("tokenizer_processor", tokenizer)
        pre.add("device_processor", {"device": device, "float_dtype": None})
    else:
        pre.add("pi0_new_line_processor", {})
        pre.add("tokenizer_processor", tokenizer)
        pre.add("device_processor", {"device": device, "float_dtype": None})
        pre.add(*normalizer)
    post = Pipeline(POSTPROCESSOR)
    post.add(UNNORMALIZER, normalizer_config(dict(output_features)), state)
    post.add("device_processor", {"device": "cpu", "float_dtype": None})
    return [pre, post]


def write_processor_files(pipelines: list[Pipeline], directory: Path) -> list[str]:
    """Each pipeline's state files (`save_file`, no metadata) and config JSON into `directory`,
    as `DataProcessorPipeline.save_pretrained(directory)` writes them; the names written."""
    from safetensors.torch import save_file

    names = []
    for p in pipelines:
        for state_file, tensors in p.states.items():
            save_file({k: v.clone() for k, v in tensors.items()}, str(Path(directory) / state_file))
            names.append(state_file)
        (Path(directory) / p.file_name).write_text(p.config_text())
        names.append(p.file_name)
    return names


# ---- reading ----------------------------------------------------------------------------------


def _load_config(path: Path) -> dict:
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: not a JSON processor config ({str(e).splitlines()[0]})") from None
    if not isinstance(config, dict) or not isinstance(config.get("steps"), list):
        raise UserError(f"{path}: 'steps' must be a list of steps (a LeRobot DataProcessorPipeline config)")
    for i, step in enumerate(config["steps"]):
        if not isinstance(step, dict) or not ("registry_name" in step or "class" in step):
            raise UserError(f"{path}: steps[{i}] must be an object with 'registry_name' or 'class'")
    return config


def _is_step(step: dict, registry_name: str, class_name: str) -> bool:
    if "registry_name" in step:
        return step["registry_name"] == registry_name
    return str(step.get("class", "")).rsplit(".", 1)[-1] == class_name


def _step_stats(path: Path, i: int, step: dict) -> tuple[dict[str, NormMode], dict[str, dict], float, Path | None]:
    """(modes, stats, eps, state file) of an (un)normalizer step, as LeRobot would apply them."""
    import torch

    where = f"{path}: steps[{i}]"
    config = step.get("config", {})
    if not isinstance(config, dict):
        raise UserError(f"{where}.config must be an object")
    features = config.get("features", {})
    if not isinstance(features, dict):
        raise UserError(f"{where}.config.features must be an object {{key: {{type, shape}}}}")
    types = {}
    for key, ft in features.items():
        if not isinstance(ft, dict) or ft.get("type") not in FEATURE_TYPES:
            got = ft.get("type") if isinstance(ft, dict) else ft
            raise UserError(f"{where}.config.features[{key!r}].type: {got!r} is not a feature type ({', '.join(FEATURE_TYPES)})")
        if not isinstance(ft.get("shape"), list) or not all(isinstance(n, int) for n in ft["shape"]):
            raise UserError(f"{where}.config.features[{key!r}].shape: {ft.get('shape')!r} is not a list of ints")
        types[key] = ft["type"]
    norm_map = config.get("norm_map", {})
    if not isinstance(norm_map, dict):
        raise UserError(f"{where}.config.norm_map must be an object {{feature type: mode}}")
    modes_by_type = {}
    for ft_type, mode in norm_map.items():
        if ft_type not in FEATURE_TYPES:
            raise UserError(f"{where}.config.norm_map: {ft_type!r} is not a feature type ({', '.join(FEATURE_TYPES)})")
        if not isinstance(mode, str) or mode not in NormMode.__members__:
            raise UserError(f"{where}.config.norm_map.{ft_type}: {mode!r} is not a mode ({', '.join(NormMode.__members__)})")
        modes_by_type[ft_type] = NormMode[mode]
    eps = config.get("eps", 1e-8)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise UserError(f"{where}.config.eps: {eps!r} is not a number")
    only = config.get("normalize_observation_keys")
    if only is not None and not (isinstance(only, list) and all(isinstance(k, str) for k in only)):
        raise UserError(f"{where}.config.normalize_observation_keys: {only!r} is not a list of keys")

    flat, state_path = {}, None
    if "state_file" in step:
        if not isinstance(step["state_file"], str) or not (path.parent / step["state_file"]).is_file():
            raise UserError(f"{where}.state_file: {step['state_file']!r} is not a file beside {path.name}")
        state_path = path.parent / step["state_file"]
        from safetensors.torch import load_file

        try:
            flat = load_file(str(state_path))
        except Exception as e:  # safetensors raises its own error types for a bad header
            raise UserError(f"{state_path}: not a safetensors file ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    stats: dict[str, dict] = {}
    for flat_key, tensor in flat.items():
        if "." not in flat_key:
            raise UserError(f"{state_path}: key {flat_key!r} is not '<feature>.<stat>'")
        key, stat = flat_key.rsplit(".", 1)
        stats.setdefault(key, {})[stat] = tensor.to(dtype=torch.float32)

    # observations: the features not of type ACTION (those of normalize_observation_keys where
    # given); actions: LeRobot's `action` key with the ACTION mode, whatever the features name
    targets = [(k, t) for k, t in types.items() if t != "ACTION" and (only is None or k in only)] + [("action", "ACTION")]
    modes: dict[str, NormMode] = {}
    kept: dict[str, dict] = {}
    for key, ft_type in targets:
        mode = modes_by_type.get(ft_type, NormMode.IDENTITY)
        if mode is NormMode.IDENTITY or key not in stats:
            continue  # LeRobot passes such a feature through unchanged
        for name in REQUIRED_STATS[mode]:
            if name not in stats[key]:
                raise UserError(
                    f"{state_path}: no {key + '.' + name!r} ({mode.value} for {key!r} needs {' and '.join(REQUIRED_STATS[mode])})"
                )
        modes[key] = mode
        kept[key] = {name: stats[key][name] for name in REQUIRED_STATS[mode]}
    return modes, kept, float(eps), state_path


def read_processor_normalizer(directory: Path, rename: Mapping[str, str] | None = None) -> Normalizer | None:
    """The normalization of a LeRobot policy directory's processor files (the preprocessor's
    normalizer and the postprocessor's unnormalizer, which must agree where both name a feature),
    features renamed by `rename`; None where the directory has neither file. Stats are the files'
    float32 tensors (as float64 arrays, exactly)."""
    import torch

    directory = Path(directory)
    modes: dict[str, NormMode] = {}
    stats: dict[str, dict] = {}
    origin: dict[str, Path] = {}
    eps: tuple[float, Path] | None = None
    found = False
    for name, registry_name, class_name in (
        (PREPROCESSOR, NORMALIZER, "NormalizerProcessorStep"),
        (POSTPROCESSOR, UNNORMALIZER, "UnnormalizerProcessorStep"),
    ):
        path = directory / f"{name}.json"
        if not path.is_file():
            continue
        found = True
        config = _load_config(path)
        for i, step in enumerate(config["steps"]):
            if not _is_step(step, registry_name, class_name):
                continue
            step_modes, step_stats, step_eps, state_path = _step_stats(path, i, step)
            if not step_modes:
                continue  # normalizes nothing
            if eps is not None and step_eps != eps[0]:
                raise UserError(f"{path}: steps[{i}].config.eps is {step_eps!r}, {eps[1].name}'s is {eps[0]!r}")
            eps = (step_eps, path)
            for key, mode in step_modes.items():
                if key in modes and (modes[key] is not mode or any(not torch.equal(stats[key][s], v) for s, v in step_stats[key].items())):
                    raise UserError(f"{state_path}: {key!r} is normalized differently in {origin[key].name}")
                modes[key], stats[key], origin[key] = mode, step_stats[key], state_path
    if not found:
        return None
    if rename:
        modes = {rename.get(k, k): m for k, m in modes.items()}
        stats = {rename.get(k, k): s for k, s in stats.items()}
        origin = {rename.get(k, k): p for k, p in origin.items()}
    arrays = {k: {s: v.numpy() for s, v in d.items()} for k, d in stats.items()}
    try:
        return Normalizer(arrays, modes, eps=1e-8 if eps is None else eps[0])
    except UserError as e:
        where = sorted({str(p) for p in origin.values()})
        raise UserError(f"{', '.join(where) or directory}: {e}") from None
