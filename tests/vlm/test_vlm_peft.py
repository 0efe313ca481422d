"""VLM LoRA runs in PEFT's format: `lf_to_peft` / `convert --peft` writes an adapter directory that
transformers + peft load onto the HF base (Qwen2.5-VL, Qwen3-VL) with no missing or unexpected keys
and our logits: adapters on exactly the language model's linears (by their transformers paths), the
vision parts the run trained whole as `modules_to_save`; a run without LoRA is refused in one line."""

import json
import re

import pytest
import torch
from conftest import run_cli
from test_vlm_train import FAST, VLM, demo_inputs

# arch -> (shipped tiny config, HF class)
ARCHS = {
    "qwen2_5_vl": ("qwen2_5_vl_tiny", "Qwen2_5_VLForConditionalGeneration"),
    "qwen3_vl": ("qwen3_vl_tiny", "Qwen3VLForConditionalGeneration"),
}
LINEARS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def train(arch, run_dir, *extra, steps):
    args = ["train", ARCHS[arch][0], *FAST, f"train.train_iters={steps}", f"checkpoint.run_dir={run_dir}", *extra]
    r = run_cli(args, module=VLM)
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """arch -> a 2-step demo run of its tiny config: its HF export is the LoRA runs' base."""
    made = {}

    def get(arch):
        if arch not in made:
            made[arch] = train(arch, tmp_path_factory.mktemp(arch) / "base", steps=2)
        return made[arch]

    return get


@pytest.fixture(scope="module")
def lora(base, tmp_path_factory):
    """(arch, freeze overrides) -> a 3-step LoRA run from the base's HF export."""
    made = {}

    def get(arch, *frozen):
        if (arch, frozen) not in made:
            made[arch, frozen] = train(
                arch,
                tmp_path_factory.mktemp("lora") / "run",
                f"checkpoint.load={base(arch) / 'hf'}",
                "lora.rank=4",
                "lora.alpha=8",
                "train.lr=1e-2",
                "train.lr_warmup_iters=0",
                "checkpoint.export_hf=false",
                *frozen,
                steps=3,
            )
        return made[arch, frozen]

    return get


@pytest.mark.parametrize(
    "arch,frozen,to_save",
    [
        ("qwen2_5_vl", (), ["model.visual"]),
        ("qwen2_5_vl", ("freeze.vision=true",), ["model.visual.merger"]),
        (
            "qwen3_vl",
            ("freeze.vision=true",),
            ["model.visual.deepstack_merger_list.0", "model.visual.deepstack_merger_list.1", "model.visual.merger"],
        ),
    ],
    ids=["qwen2_5_vl-vision-trained", "qwen2_5_vl-merger-trained", "qwen3_vl-mergers-trained"],
)
def test_peft_export_loads_in_transformers_with_our_logits(arch, frozen, to_save, base, lora, tmp_path):
    import peft
    import transformers
    from loongforge.vlm import load_model
    from loongforge.vlm.model_io import lf_to_peft
    from safetensors import safe_open

    run, base_hf = lora(arch, *frozen), base(arch) / "hf"
    out = lf_to_peft(run, tmp_path / "adapter")
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8 and cfg["base_model_name_or_path"] == str(base_hf)
    assert cfg["modules_to_save"] == to_save
    assert (out / "tokenizer_config.json").is_file()

    hf = getattr(transformers, ARCHS[arch][1]).from_pretrained(str(base_hf), dtype=torch.float32).eval()
    # the adapters: on every linear of the language model and nothing else (Qwen2.5-VL's vision
    # blocks have gate/up/down_proj too), named by the model's module paths
    hit = sorted(n for n, _ in hf.named_modules() if re.fullmatch(cfg["target_modules"], n))
    layers = hf.config.text_config.num_hidden_layers
    assert hit == sorted(f"model.language_model.layers.{i}.{part}.{p}" for i in range(layers) for part, ps in LINEARS.items() for p in ps)
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        keys = set(f.keys())
    saved = {f"base_model.model.{k}" for m in to_save for k, _ in hf.get_submodule(m).named_parameters(prefix=m)}
    assert keys == {f"base_model.model.{m}.lora_{ab}.weight" for m in hit for ab in "AB"} | saved

    b = demo_inputs(base(arch))
    keep = b["attention_mask"].bool()
    ours = load_model(run).hf_logits(**b)
    with torch.no_grad():
        plain = hf(**b).logits
    model = peft.PeftModel.from_pretrained(hf, str(out)).eval()
    check = model.load_adapter(str(out), adapter_name="check")  # a second load, to see what it found
    assert not check.missing_keys and not check.unexpected_keys, (check.missing_keys[:3], check.unexpected_keys[:3])
    model.set_adapter("default")
    with torch.no_grad():
        theirs = model(**b).logits
    err = float((theirs[keep] - ours[keep]).abs().max() / ours[keep].abs().max())
    print(f"{arch} {' '.join(frozen) or 'vision trained'}: peft vs ours, max abs error / max abs logit = {err:.3e}")
    assert (plain[keep] - ours[keep]).abs().max() > 1e-3  # the run changed the model
    assert err < 1e-5, err


def test_convert_peft_records_the_base_given(lora, tmp_path):
    run, out = lora("qwen2_5_vl"), tmp_path / "adapter"
    r = run_cli(["convert", str(run), str(out), "--peft", "--base", "/models/Qwen2.5-VL-7B-Instruct"], module=VLM)
    assert r.returncode == 0 and r.stdout.strip() == f"wrote {out}", r.stderr[-2000:]
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == "/models/Qwen2.5-VL-7B-Instruct" and cfg["peft_type"] == "LORA"
    assert (out / "adapter_model.safetensors").is_file() and (out / "tokenizer_config.json").is_file()


def test_convert_peft_refuses_a_run_without_lora(base, tmp_path):
    out = tmp_path / "adapter"
    r = run_cli(["convert", str(base("qwen2_5_vl")), str(out), "--peft"], module=VLM)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert lines[0].startswith("error: ") and "has no LoRA adapters" in lines[0] and "without --peft" in lines[0], lines
    assert not out.exists()
    r = run_cli(["convert", str(base("qwen2_5_vl")), str(out), "--base", "/models/x"], module=VLM)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "use it with --peft" in lines[0] and not out.exists(), r.stderr[-2000:]


def test_modules_to_save_cover_exactly_the_trained_tensors():
    from loongforge.core.foundation.hf_io import peft_modules_to_save

    names = [
        "model.visual.patch_embed.proj.weight",
        "model.visual.blocks.0.attn.qkv.weight",
        "model.visual.blocks.1.attn.qkv.weight",
        "model.visual.merger.ln_q.weight",
        "model.visual.merger.mlp.0.weight",
        "model.visual.merger.mlp.2.weight",
        "model.language_model.layers.0.self_attn.q_proj.weight",
        "lm_head.weight",
    ]
    assert peft_modules_to_save(names[:6], names) == ["model.visual"]
    assert peft_modules_to_save(names[3:6], names) == ["model.visual.merger"]
    # a ModuleList is never a module to save (PEFT cannot stand in for one): its numbered children are
    assert peft_modules_to_save(names[:3], names) == ["model.visual.blocks.0", "model.visual.blocks.1", "model.visual.patch_embed"]
    assert peft_modules_to_save(names[4:5], names) == ["model.visual.merger.mlp.0"]
    assert peft_modules_to_save([], names) == []
