"""Packed-sequence causal attention through torch's flash varlen kernel
(`torch.nn.attention.varlen.varlen_attn`, CUDA, fp16/bf16): one launch for the whole pack,
never attending across samples. Other dtypes, devices, torch builds and value head sizes other
than the query's use core's reference."""

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


def varlen_attention(q, k, v, cu_seqlens, scale=None, max_seqlen=None):
    fn, params = _torch_varlen()
    # (the flash kernel takes one head size for queries, keys and values: MLA's differ)
    if fn is None or not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16) or v.shape[-1] != q.shape[-1]:
        return reference.varlen_attention(q, k, v, cu_seqlens, scale, max_seqlen)
    if max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    kw = {}
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    if "is_causal" in params:
        kw["is_causal"] = True
    else:
        kw["window_size"] = (-1, 0)
    if scale is not None:
        if "scale" not in params:
            return reference.varlen_attention(q, k, v, cu_seqlens, scale, max_seqlen)
        kw["scale"] = scale
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    return fn(q, k, v, cu, cu, max_seqlen, max_seqlen, **kw)
