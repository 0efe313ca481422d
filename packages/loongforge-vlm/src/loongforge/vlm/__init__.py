"""loongforge.vlm: vision-language models (Qwen2.5-VL's vision tower with a decoder family of
core's foundation) trained on conversations with images and videos; HF formats in and out.

    from loongforge.vlm import load_model
"""


def load_model(path):
    """See `loongforge.vlm.model_io.load_model`."""
    from loongforge.vlm.model_io import load_model as _load

    return _load(path)


__all__ = ["load_model"]
