"""`loongforge-embodied convert`: a trained run's policy as a LeRobot pi0 / pi0.5 directory.

    lerobot_dir = export_lerobot(Path("runs/pi"), Path("export/pi"))
    norm = lerobot_normalizer(lerobot_dir)    # the normalization back, from its processor files

The directory holds `model.safetensors` under LeRobot's names (the same file `checkpoint.load`
reads, so a run can start from it again), LeRobot 0.4's processor files (`policy_preprocessor.json`,
`policy_postprocessor.json` and their (un)normalizer stats, see `lerobot_processor`) from the run's
`normalizer.json` (its first dataset's, as serving uses) and, where LeRobot's configs can name the
policy's shape, its `config.json`. Weights go the other way through `checkpoint.load`, the
normalization through `lerobot_normalizer`.
"""

from __future__ import annotations

import json
from pathlib import Path

from loongforge.core.outputs import replaced_dir, require_new_dir

LEROBOT_KEYS = ("observation.state", "action")  # LeRobot's names of the state and the action


def export_lerobot(run_dir: Path, out: Path, ema: bool | None = None) -> tuple[Path, bool]:
    """Write the run's newest checkpoint and its normalization to `out` (new or empty); (out,
    whether config.json was written). `ema` as `read_run` takes it."""
    from loongforge.embodied.data.normalize import Normalizer, NormMode
    from loongforge.embodied.lerobot_processor import pi_processor_files, policy_features, stats_state, write_processor_files
    from loongforge.embodied.policies.lerobot_format import lerobot_config, to_lerobot
    from loongforge.embodied.serving import read_run
    from safetensors.torch import save_file

    out = require_new_dir(out)
    cfg, state = read_run(run_dir, ema)
    policy = cfg.policy.resolved()
    io = json.loads((Path(run_dir) / "policy_io.json").read_text())
    per_dataset = json.loads((Path(run_dir) / "normalizer.json").read_text())
    normalizer = Normalizer.from_state_dict(next(iter(per_dataset.values())))  # the first dataset's, as served
    keys = {cfg.data.state_key: LEROBOT_KEYS[0], cfg.data.action_key: LEROBOT_KEYS[1]}
    mode = {lerobot: normalizer.modes.get(ours, NormMode.IDENTITY).value for ours, lerobot in keys.items()}
    config = lerobot_config(
        policy,
        io["cameras"],
        io["state_dim"],
        io["action_dim"],
        {"state": mode[LEROBOT_KEYS[0]], "action": mode[LEROBOT_KEYS[1]]},
        cfg.data.max_prompt_tokens,
    )
    inputs, outputs = policy_features(io["cameras"], policy.vision.image_size, io["state_dim"], io["action_dim"])
    norm_map = {"VISUAL": "IDENTITY", "STATE": mode[LEROBOT_KEYS[0]], "ACTION": mode[LEROBOT_KEYS[1]]}
    pipelines = pi_processor_files(
        policy.variant, inputs, outputs, norm_map, stats_state(normalizer, keys), normalizer.eps, cfg.data.max_prompt_tokens
    )
    tensors = {k: v.contiguous() for k, v in to_lerobot(policy, state).items()}
    with replaced_dir(out) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        write_processor_files(pipelines, tmp)
        if config is not None:
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out, config is not None


def lerobot_normalizer(lerobot_dir: Path, state_key: str = "observation.state", action_key: str = "action"):
    """The normalization (a `Normalizer`, features named `state_key` and `action_key`) that a
    LeRobot pi0 / pi0.5 directory's processor files hold; None where it has none. A malformed file
    is a one-line UserError naming the file and the key."""
    from loongforge.embodied.lerobot_processor import read_processor_normalizer

    return read_processor_normalizer(Path(lerobot_dir), {LEROBOT_KEYS[0]: state_key, LEROBOT_KEYS[1]: action_key})
