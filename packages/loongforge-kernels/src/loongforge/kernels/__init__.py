"""loongforge.kernels: Triton kernels for core's op table (RMSNorm with optional residual add,
RoPE, SwiGLU, fused linear + cross-entropy, MoE permute/unpermute) and packed attention through
torch's flash varlen kernel. Registered by entry point; chosen by default on CUDA devices."""
