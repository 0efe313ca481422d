"""loongforge.xpu: Kunlun XPU accelerator plugin (placeholder: filled by a later issue)."""
