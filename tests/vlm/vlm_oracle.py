"""What the VLM architectures' oracle tests share: a perturbed random HF model saved as the
source, the HF and LoongForge pair built from it, the error measure, and the round trip (every
tensor bit-identical, the export's logits equal HF's, the config read back equal)."""

import torch
from conftest import perturbed, run_cli
from loongforge.core.foundation.families import QWEN2, QWEN3
from loongforge.core.parallel import init_parallel
from loongforge.vlm.model import VisionLanguageModel, read_hf_config

FAMILIES = {"qwen2": QWEN2, "qwen3": QWEN3}


def save_perturbed(hf_class, config, out):
    """A random HF model moved away from its init (biases and norms too), saved to `out`."""
    perturbed(lambda: hf_class(config), 0.05).save_pretrained(str(out))
    return out


def load_pair(hf_class, hf_dir):
    """(HF's model, ours) from one directory, fp32, eval mode."""
    ref = hf_class.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    ours = VisionLanguageModel.from_hf(hf_dir, FAMILIES, init_parallel(1, 1, "gloo", "cpu")).eval()
    return ref, ours


def row_error(got, want, keep, r: int) -> float:
    """Row r's largest difference over its kept tokens, relative to the largest logit."""
    return float((got[r][keep[r]] - want[r][keep[r]]).abs().max() / want.abs().max())


def assert_round_trip(hf_class, ref, ours, hf_dir, out, inputs: dict) -> None:
    from loongforge.core.foundation.hf_io import load_hf_state

    src = load_hf_state(hf_dir)
    back = ours.hf_state_dict()
    assert set(back) == set(src) and all(torch.equal(back[k], src[k]) for k in src)
    ours.save_hf(out)
    again = hf_class.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(again(**inputs).logits, ref(**inputs).logits)
    _, cfg = read_hf_config(out, FAMILIES)
    assert cfg == ours.cfg


def train_demo(config: str, run_dir, *overrides: str):
    """The shipped `config` trains 12 steps on 48 demo samples of 128 tokens (the CLI's run)."""
    r = run_cli(
        [
            "train",
            config,
            "data.demo_samples=48",
            "data.seq_length=128",
            "train.train_iters=12",
            "train.log_interval=1",
            f"checkpoint.run_dir={run_dir}",
            *overrides,
        ],
        module="loongforge.vlm.cli",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def save_tiny_llava_onevision(out, image_token: int, video_token: int, vocab: int = 96, pinpoints=((28, 28), (28, 56), (56, 28), (56, 56))):
    """A tiny perturbed `LlavaOnevisionForConditionalGeneration` (SigLIP 28 px tiles of 7 px
    patches, a 2-layer Qwen2) saved to `out`."""
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration

    cfg = LlavaOnevisionConfig(
        text_config=dict(
            model_type="qwen2",
            vocab_size=vocab,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
        vision_config=dict(
            model_type="siglip_vision_model",
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=28,
            patch_size=7,
            vision_use_head=False,
        ),
        image_token_index=image_token,
        video_token_index=video_token,
        image_grid_pinpoints=[list(p) for p in pinpoints],
    )
    return save_perturbed(LlavaOnevisionForConditionalGeneration, cfg, out)
