"""Packed-sequence attention through torch's flash varlen kernel
(`torch.nn.attention.varlen.varlen_attn`, CUDA, fp16/bf16): one launch for the whole pack,
never attending across samples; causal (`varlen_attention`: packed LLM samples) or bidirectional
with separate query and key bounds (`packed_attention`: a ViT's windows and images, a diffusion
transformer's samples). Other dtypes, devices, torch builds, head sizes the kernel does not take
(not a multiple of 8, over 256) and value head sizes other than the query's use core's reference."""

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


def varlen_attention(q, k, v, cu_seqlens, scale=None, max_seqlen=None):
    out = _flash(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, True, scale)
    return reference.varlen_attention(q, k, v, cu_seqlens, scale, max_seqlen) if out is None else out


def packed_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=None, max_seqlen_q=None, max_seqlen_k=None):
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ValueError(f"packed_attention: {cu_seqlens_q.shape[0] - 1} query samples but {cu_seqlens_k.shape[0] - 1} key samples")
    if cu_seqlens_q.shape[0] == 2:
        # one sample: SDPA over the whole rows, which takes cuDNN's attention on Hopper: 1.7x the
        # flash varlen kernel's backward at Wan's 32,760 tokens on an H200
        return reference.packed_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, max_seqlen_q, max_seqlen_k)
    out = _flash(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, False, scale)
    if out is None:
        return reference.packed_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, max_seqlen_q, max_seqlen_k)
    return out
