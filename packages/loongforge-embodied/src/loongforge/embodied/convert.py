"""`loongforge-embodied convert`: a trained run's policy as a LeRobot pi0 / pi0.5 directory.

    lerobot_dir = export_lerobot(Path("runs/pi"), Path("export/pi"))

The directory holds `model.safetensors` under LeRobot's names (the same file `checkpoint.load`
reads, so a run can start from it again) and, where LeRobot's configs can name the policy's
shape, its `config.json`. Weights go the other way through `checkpoint.load`.
"""

from __future__ import annotations

import json
from pathlib import Path

from loongforge.core.outputs import replaced_dir, require_new_dir


def export_lerobot(run_dir: Path, out: Path, ema: bool | None = None) -> tuple[Path, bool]:
    """Write the run's newest checkpoint to `out` (new or empty); (out, whether config.json was
    written). `ema` as `read_run` takes it."""
    from loongforge.embodied.policies.lerobot_format import lerobot_config, to_lerobot
    from loongforge.embodied.serving import read_run
    from safetensors.torch import save_file

    out = require_new_dir(out)
    cfg, state = read_run(run_dir, ema)
    policy = cfg.policy.resolved()
    io = json.loads((Path(run_dir) / "policy_io.json").read_text())
    modes = cfg.data.normalization
    config = lerobot_config(
        policy,
        io["cameras"],
        io["state_dim"],
        io["action_dim"],
        {"state": modes.get(cfg.data.state_key, "IDENTITY"), "action": modes.get(cfg.data.action_key, "IDENTITY")},
        cfg.data.max_prompt_tokens,
    )
    tensors = {k: v.contiguous() for k, v in to_lerobot(policy, state).items()}
    with replaced_dir(out) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if config is not None:
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out, config is not None
