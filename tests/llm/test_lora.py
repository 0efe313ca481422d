"""LoRA: adapters on megatron's parallel linears. Frozen base, adapters-only checkpoints that
resume exactly, PEFT export that transformers + peft load with our logits, merged HF export,
TP=2 and PP=2 (with recompute) equal to one process, and the user errors."""

import json

import pytest
import torch
from conftest import losses, run_cli

# constant LR (so a run cut short and resumed follows the same schedule), no dropout (so
# layouts can be compared), every linear, global batch = all six samples packed
COMMON = [
    "train.lr_warmup_iters=0",
    "train.lr=5e-3",
    "train.min_lr=5e-3",
    "train.log_interval=1",
    "data.seq_length=256",
    "lora.dropout=0.0",
    "lora.rank=4",
    "lora.alpha=8",
    "train.micro_batch_size=1",
    "train.global_batch_size=3",
]


def _lora(rows_file, run_dir, base, *extra, nproc=1):
    return run_cli(
        [
            "train",
            "lora",
            *COMMON,
            f"data.datasets=[{{path: {rows_file}, format: alpaca}}]",
            f"checkpoint.load={base}",
            f"checkpoint.run_dir={run_dir}",
            *extra,
        ],
        nproc=nproc,
    )


@pytest.fixture(scope="module")
def trained(rows_file, hf_llama4, tmp_path_factory):
    d = tmp_path_factory.mktemp("lora_run")
    r = _lora(rows_file, d, hf_llama4, "train.train_iters=4")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "exported PEFT adapter" in r.stdout
    return d


@pytest.mark.slow
def test_checkpoint_holds_only_adapters(trained):
    from torch.distributed.checkpoint import FileSystemReader

    keys = list(FileSystemReader(str(trained / "checkpoints" / "step_00000004")).read_metadata().state_dict_metadata)
    model_keys = [k for k in keys if not k.startswith("optimizer")]
    assert model_keys and all(k.endswith(("lora_a", "lora_b")) for k in keys if "layers" in k), keys
    assert not [k for k in keys if "embedding" in k or "layernorm" in k or k.endswith(".weight")], keys
    got = losses(trained)
    assert got[4] < got[1]


@pytest.mark.slow
def test_peft_export_loads_in_transformers_with_our_logits(trained, hf_llama4):
    import peft
    import transformers
    from loongforge.llm import load_model

    cfg = json.loads((trained / "hf_adapter" / "adapter_config.json").read_text())
    assert (
        cfg["r"] == 4
        and cfg["lora_alpha"] == 8
        and set(cfg["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    )
    ids = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    ours = load_model(trained)(ids)
    with torch.no_grad():
        base = transformers.AutoModelForCausalLM.from_pretrained(str(hf_llama4), dtype=torch.float32).eval()
        base_logits = base(ids).logits
        theirs = peft.PeftModel.from_pretrained(base, str(trained / "hf_adapter")).eval()(ids).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(str(trained / "hf"), dtype=torch.float32).eval()(ids).logits
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    assert rel(base_logits, ours) > 1e-3  # the adapters changed the model
    assert rel(theirs, ours) < 1e-6, rel(theirs, ours)
    assert rel(merged, ours) < 1e-5, rel(merged, ours)


@pytest.mark.slow
def test_resume_from_adapters_only_checkpoint(trained, rows_file, hf_llama4, tmp_path):
    r = _lora(rows_file, tmp_path, hf_llama4, "train.train_iters=2", "checkpoint.export_hf=false")
    assert r.returncode == 0, r.stderr[-3000:]
    r = _lora(rows_file, tmp_path, hf_llama4, "train.train_iters=4", "checkpoint.export_hf=false")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout
    want, got = losses(trained), losses(tmp_path)
    for step in (3, 4):
        assert abs(got[step] - want[step]) <= 1e-6 * want[step], (step, got[step], want[step])


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        ["parallel.tensor_model_parallel_size=2"],
        ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"],
        ["parallel.pipeline_model_parallel_size=2", "train.recompute=true"],
    ],
)
def test_two_process_lora_matches_single(layout, trained, rows_file, hf_llama4, tmp_path):
    r = _lora(rows_file, tmp_path, hf_llama4, "train.train_iters=4", "checkpoint.export_hf=false", *layout, nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    want, got = losses(trained), losses(tmp_path)
    for step in range(1, 5):
        assert abs(got[step] - want[step]) <= 1e-5 * want[step], (layout, step, got[step], want[step])


@pytest.mark.slow
def test_lora_user_errors(trained, rows_file, hf_llama4, tmp_path):
    from test_bad_input import _one_line_error

    _one_line_error(
        run_cli(["train", "lora", f"checkpoint.run_dir={tmp_path / 'a'}", "checkpoint.load=null"]), "set checkpoint.load to the base model"
    )
    # the config's own checks are test_bad_lora_config's; one found on the built model:
    _one_line_error(_lora(rows_file, tmp_path / "d", hf_llama4, "lora.target_modules=[decoder.layers.9*.mlp.*]"), "matched no linear")
    # a checkpoint without adapters has nothing for lf-to-peft; the output directory stays untouched
    base_ckpt = tmp_path / "base_ckpt"
    from loongforge.llm.model_io import hf_to_lf

    hf_to_lf(hf_llama4, base_ckpt)
    _one_line_error(run_cli(["convert", "lf-to-peft", str(base_ckpt), str(tmp_path / "out")]), "has no LoRA adapters")
    assert not (tmp_path / "out").exists()
    # the base a LoRA checkpoint was trained from is gone: say so, and how to point at it
    moved = tmp_path / "moved_base"
    import shutil

    shutil.copytree(hf_llama4, moved)
    run = tmp_path / "lora_moved"
    assert _lora(rows_file, run, moved, "train.train_iters=1", "checkpoint.export_hf=false").returncode == 0
    shutil.rmtree(moved)
    _one_line_error(run_cli(["convert", "lf-to-hf", str(run), str(tmp_path / "merged")]), "holds LoRA adapters only", "--base")
    r = run_cli(["convert", "lf-to-hf", str(run), str(tmp_path / "merged"), "--base", str(hf_llama4)])
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"target_modules": ["q_proj", "v_proj"]}, "q_proj, v_proj share one fused linear (linear_qkv) with k_proj"),
        ({"target_modules": ["qkv"]}, "unknown module 'qkv'"),
        ({"rank": -1}, "lora.rank=-1 must be positive"),
        ({"alpha": 0}, "lora.alpha=0 must be positive"),
        ({"dropout": 1.0}, "lora.dropout=1.0 must be in [0, 1)"),
        ({"target_modules": []}, "lora.target_modules is empty"),
    ],
)
def test_bad_lora_config(fields, message):
    """The `lora` section's checks (the CLI prints them as one line, exit 2: test_lora_user_errors)."""
    import re

    from loongforge.core.errors import UserError
    from loongforge.core.foundation.lora import LoRAConfig

    with pytest.raises(UserError, match=re.escape(message)):
        LoRAConfig(**{"rank": 2, **fields}).validate()


def test_target_patterns():
    from loongforge.core.foundation.lora import LoRAConfig

    c = LoRAConfig(rank=2, target_modules=["linear_qkv", "decoder.layers.1.mlp.*"])
    assert c.targets("decoder.layers.0.self_attention.linear_qkv")
    assert not c.targets("decoder.layers.0.mlp.linear_fc1")
    assert c.targets("decoder.layers.1.mlp.linear_fc2")
    hf = LoRAConfig(rank=2, target_modules=["gate_proj", "up_proj", "o_proj"])
    assert hf.targets("decoder.layers.5.mlp.linear_fc1") and hf.targets("decoder.layers.5.self_attention.linear_proj")
    assert not hf.targets("decoder.layers.5.mlp.linear_fc2")
    assert not LoRAConfig(rank=0).targets("decoder.layers.0.mlp.linear_fc1")
    assert LoRAConfig(rank=4, alpha=8).scale == 2.0 and LoRAConfig(rank=4, alpha=8, rslora=True).scale == 4.0
