"""`GraphedCall`: a function of tensors replayed from CUDA graphs, for launch-bound inference
(a policy's action chunk at batch 1 launches thousands of small kernels; one graph replay
launches them all at once)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]
    single: bool  # fn returned one tensor, not a tuple


class GraphedCall:
    """`GraphedCall(fn)(*tensors)` returns what `fn(*tensors)` returns (a tensor or a tuple of
    tensors), replayed from a CUDA graph captured the first time its input signature (each
    tensor's shape, stride, dtype and device) is seen: the inputs are copied into the graph's own
    buffers and the outputs cloned out of them. At most `max_graphs` signatures are kept (the
    least recently used is dropped). Inputs off CUDA run `fn` directly.

    `fn` must not synchronize with the host (no `.item()`, `.tolist()`, data-dependent shapes)
    and must read no state that changes between calls other than tensors updated in place (a
    module's parameters after `load_state_dict`): a replay repeats the captured kernels on the
    captured addresses. Random numbers belong in the inputs."""

    def __init__(self, fn: Callable, max_graphs: int = 4, warmup: int = 2):
        if max_graphs < 1 or warmup < 1:
            raise ValueError(f"GraphedCall: max_graphs={max_graphs} and warmup={warmup} must be at least 1")
        self.fn, self.max_graphs, self.warmup = fn, max_graphs, warmup
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()

    def __call__(self, *args: torch.Tensor):
        for i, a in enumerate(args):
            if not isinstance(a, torch.Tensor):
                raise TypeError(f"GraphedCall: argument {i} is a {type(a).__name__}, not a tensor")
        if not args or not all(a.is_cuda for a in args):
            return self.fn(*args)
        key = tuple((tuple(a.shape), a.dtype, a.device, a.stride()) for a in args)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(args)
            self._graphs[key] = entry
            while len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(key)
            for buf, a in zip(entry.inputs, args):
                buf.copy_(a)
        entry.graph.replay()
        outs = tuple(o.clone() for o in entry.outputs)
        return outs[0] if entry.single else outs

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def _capture(self, args: tuple[torch.Tensor, ...]) -> _Graph:
        inputs = tuple(a.clone() for a in args)
        # warm-up on a side stream (lazy initialization, autotuning, cuBLAS workspaces stay out of
        # the capture), as torch's capture recipe asks
        side = torch.cuda.Stream(device=args[0].device)
        side.wait_stream(torch.cuda.current_stream(args[0].device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self.fn(*inputs)
        torch.cuda.current_stream(args[0].device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self.fn(*inputs)
        single = isinstance(out, torch.Tensor)
        outputs = (out,) if single else tuple(out)
        if not all(isinstance(o, torch.Tensor) for o in outputs):
            raise TypeError("GraphedCall: fn must return a tensor or a tuple of tensors")
        return _Graph(graph, inputs, outputs, single)
