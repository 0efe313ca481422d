"""loongforge.kernels: Triton fused kernels registered into core's op table (placeholder: filled by a later issue)."""
