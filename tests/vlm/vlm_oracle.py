"""What the VLM architectures' oracle tests share: a perturbed random HF model saved as the
source, the HF and LoongForge pair built from it, the error measure, and the round trip (every
tensor bit-identical, the export's logits equal HF's, the config read back equal)."""

import torch
from loongforge.core.foundation.families import QWEN2, QWEN3
from loongforge.core.parallel import init_parallel
from loongforge.vlm.model import VisionLanguageModel, read_hf_config

FAMILIES = {"qwen2": QWEN2, "qwen3": QWEN3}


def save_perturbed(hf_class, config, out):
    """A random HF model moved away from its init (biases and norms too), saved to `out`."""
    torch.manual_seed(0)
    model = hf_class(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(str(out))
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
