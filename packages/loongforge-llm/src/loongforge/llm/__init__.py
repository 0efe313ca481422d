"""loongforge.llm: LLM recipes (pretraining, SFT, LoRA, mid-training) on either stack, HF import/export,
pretraining data (megatron indexed datasets; the text data it shares with vlm is core's).

    from loongforge.llm import load_model
    model = load_model("path/to/hf_or_checkpoint")
    logits = model(input_ids)  # [batch, seq, vocab], CPU fp32
"""


def load_model(path):
    """An HF directory or LoongForge checkpoint as a CPU fp32 module giving logits."""
    from loongforge.llm.model_io import load_model as _load

    return _load(path)


__all__ = ["load_model"]
