"""Packed-sequence attention through torch's flash varlen kernel
(`torch.nn.attention.varlen.varlen_attn`, CUDA, fp16/bf16): one launch for the whole pack,
never attending across samples; causal (`varlen_attention`: packed LLM samples) or bidirectional
with separate query and key bounds (`packed_attention`: a ViT's windows and images, a diffusion
transformer's samples). Where SDPA is faster, core's reference runs instead (SDPA per sample):
packs of one sample, and bidirectional packs of a few long samples (`PER_SAMPLE_*` below, with
the measurements behind them). Other dtypes, devices, torch builds, head sizes the kernel does
not take (not a multiple of 8, over 256) and value head sizes other than the query's use the
reference too."""

from __future__ import annotations

import inspect

import torch
from loongforge.core.ops import reference


def _torch_varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, set()
    return varlen_attn, set(inspect.signature(varlen_attn).parameters)


def _flash(q, k, v, cu_q, cu_k, max_q, max_k, causal: bool, scale):
    """The flash varlen call, or None where it does not apply (the caller's reference runs)."""
    fn, params = _torch_varlen()
    # (the flash kernel takes one head size for queries, keys and values, MLA's differ; a multiple
    # of 8 up to 256)
    if fn is None or not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16) or v.shape[-1] != q.shape[-1]:
        return None
    if q.shape[-1] % 8 or q.shape[-1] > 256:
        return None
    if scale is not None and "scale" not in params:
        return None
    kw = {} if scale is None else {"scale": scale}
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    if "is_causal" in params:
        kw["is_causal"] = causal
    else:
        kw["window_size"] = (-1, 0) if causal else (-1, -1)
    if max_q is None:
        max_q = int((cu_q[1:] - cu_q[:-1]).max())
    if max_k is None:
        max_k = int((cu_k[1:] - cu_k[:-1]).max())
    cu_q = cu_q.to(device=q.device, dtype=torch.int32)
    cu_k = cu_k.to(device=q.device, dtype=torch.int32)
    return fn(q, k, v, cu_q, cu_k, max_q, max_k, **kw)


# SDPA per sample (cuDNN's attention on Hopper) against the flash varlen kernel over the whole
# pack, forward + backward in bf16 on an H100 (`tools/benchmarks/kernels.py --only
# packed_attention`): bidirectional, 12 heads x 128, 4 x 8192 tokens 12.7 against 17.8 ms, the
# Wan benchmark's mix of 32760 + 14040 + 3600 + 1560 tokens 54.3 against 89.9, 8 x 4096 9.7
# against 9.2, 16 x 2048 12.9 against 4.8; causal, 32 / 8 heads x 128, one sample of 4096 tokens
# 1.5 against 2.0 ms, of 8192 4.3 against 6.6, but 4 x 2048 3.2 against 2.2.
PER_SAMPLE_MIN_LEN = 8192  # a bidirectional pack whose longest sample is this long ...
PER_SAMPLE_MAX_SAMPLES = 16  # ... and that holds at most this many samples runs SDPA per sample


def _sdpa_wins(cu_seqlens, max_seqlen, causal: bool) -> bool:
    """Whether SDPA per sample (core's reference) beats the flash kernel on this pack: one sample
    (the reference reads no bounds then), or a bidirectional pack of a few long samples."""
    samples = cu_seqlens.shape[0] - 1
    if samples == 1:
        return True
    if causal or samples > PER_SAMPLE_MAX_SAMPLES:
        return False
    longest = max_seqlen if max_seqlen is not None else int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return longest >= PER_SAMPLE_MIN_LEN


def varlen_attention(q, k, v, cu_seqlens, scale=None, max_seqlen=None):
    out = None
    if not _sdpa_wins(cu_seqlens, max_seqlen, True):
        out = _flash(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, True, scale)
    return reference.varlen_attention(q, k, v, cu_seqlens, scale, max_seqlen) if out is None else out


def packed_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=None, max_seqlen_q=None, max_seqlen_k=None):
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ValueError(f"packed_attention: {cu_seqlens_q.shape[0] - 1} query samples but {cu_seqlens_k.shape[0] - 1} key samples")
    out = None
    if not _sdpa_wins(cu_seqlens_q, max_seqlen_q, False):
        out = _flash(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, False, scale)
    if out is None:
        return reference.packed_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, max_seqlen_q, max_seqlen_k)
    return out
