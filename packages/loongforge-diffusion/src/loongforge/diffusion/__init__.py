"""loongforge.diffusion: Diffusion transformers (placeholder: filled by a later issue)."""
