"""Mid-training from a LoongForge checkpoint: the optimizer state is reset by default and kept
with checkpoint.load_optimizer=true (its AdamW moments exactly, while the step count and LR
schedule start over), and such a run resumes exactly."""

import pytest
import torch
from conftest import FAST, losses, run_cli

pytestmark = pytest.mark.slow
ARGS = [*FAST, "train.lr=1e-3", "train.min_lr=1e-3", "train.lr_warmup_iters=0"]


def _read(step_dir, key):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata[key]
    sd = {key: torch.empty(md.size, dtype=md.properties.dtype)}
    dcp.load(sd, storage_reader=FileSystemReader(str(step_dir)), no_dist=True)
    return sd[key]


def test_keep_or_reset_optimizer_state(hf_llama4, tmp_path):
    def train(run, iters, *extra):
        r = run_cli(["train", "tiny", *ARGS, f"train.train_iters={iters}", f"checkpoint.run_dir={tmp_path / run}", *extra])
        assert r.returncode == 0, r.stderr[-3000:]
        return losses(tmp_path / run) if iters else {}

    train("a", 3, f"checkpoint.load={hf_llama4}")
    src = tmp_path / "a" / "checkpoints" / "step_00000003"
    key = "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight"
    inherited = _read(src, key)
    assert inherited.abs().sum() > 0

    keep = ["checkpoint.load_optimizer=true", f"checkpoint.load={tmp_path / 'a'}"]
    full = train("full", 4, *keep, "train.save_interval=1")
    reset = train("reset", 4, f"checkpoint.load={tmp_path / 'a'}", "train.save_interval=1")
    assert full[1] == reset[1] and full[2] != reset[2]  # same weights; the kept moments change the first update
    # after the first step, from the same weights and batch: the kept first moment is
    # beta1 * inherited + (1 - beta1) * g, the reset one (1 - beta1) * g
    kept_m = _read(tmp_path / "full" / "checkpoints" / "step_00000001", key)
    reset_m = _read(tmp_path / "reset" / "checkpoints" / "step_00000001", key)
    torch.testing.assert_close(kept_m, 0.9 * inherited + reset_m, rtol=1e-5, atol=1e-7 * inherited.abs().max().item())
    train("cut", 2, *keep)
    cut = train("cut", 4, *keep)
    for step in (3, 4):
        assert abs(cut[step] - full[step]) <= 1e-6 * full[step], (step, cut[step], full[step])


def test_load_optimizer_needs_a_loongforge_checkpoint_with_state(hf_llama4, tmp_path):
    from test_bad_input import _one_line_error

    _one_line_error(
        run_cli(
            [
                "train",
                "tiny",
                *ARGS,
                f"checkpoint.load={hf_llama4}",
                "checkpoint.load_optimizer=true",
                f"checkpoint.run_dir={tmp_path / 'r'}",
            ]
        ),
        "HF directories hold none",
    )
    conv = tmp_path / "conv"
    from loongforge.llm.model_io import hf_to_lf

    hf_to_lf(hf_llama4, conv)
    _one_line_error(
        run_cli(
            ["train", "tiny", *ARGS, f"checkpoint.load={conv}", "checkpoint.load_optimizer=true", f"checkpoint.run_dir={tmp_path / 's'}"]
        ),
        "holds no optimizer state",
    )
