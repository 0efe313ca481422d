"""loongforge.diffusion: Wan video diffusion transformers trained by flow matching on
LoongForge's trainer; diffusers formats in and out.

    from loongforge.diffusion import load_model
"""


def load_model(path, ema=None):
    """See `loongforge.diffusion.model_io.load_model`."""
    from loongforge.diffusion.model_io import load_model as _load

    return _load(path, ema)


__all__ = ["load_model"]
