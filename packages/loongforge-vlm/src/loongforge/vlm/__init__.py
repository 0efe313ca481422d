"""loongforge.vlm: Vision-language models (placeholder: filled by a later issue)."""
