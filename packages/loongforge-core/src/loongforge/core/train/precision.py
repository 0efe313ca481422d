"""Low-precision parameters: with fp32 master weights (Megatron's `--bf16` scheme, the default),
or pure (`train.master_weights=false`: parameters, gradients and AdamW state all bf16, as HF
models trained with `.bfloat16()`; less memory, less precise updates).

Masters:

The model computes with bf16 parameters; every trainable one has an fp32 master, which is the
parameter object the optimizer was built over. Each micro-batch's bf16 gradient is added into
the master's fp32 `.grad` as soon as autograd finishes it (so accumulation over micro-batches is
fp32), then dropped. After the optimizer step the masters are copied into the bf16 parameters.
Checkpoints read and write the masters, so they hold fp32 weights exactly as fp32 training does,
and resuming is exact.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


class MasterWeights:
    def __init__(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        self.slots: list[tuple[torch.nn.Module, str, torch.nn.Parameter, torch.nn.Parameter]] = []  # module, name, low, master
        seen: dict[int, torch.nn.Parameter] = {}
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is None:
                    continue
                if id(p) in seen:  # the same parameter in two modules (tied weights)
                    module._parameters[name] = seen[id(p)]
                    continue
                if not p.requires_grad:
                    p.data = p.data.to(dtype)
                    seen[id(p)] = p
                    continue
                low = torch.nn.Parameter(p.detach().to(dtype))
                low.__dict__.update(p.__dict__)  # megatron's TP / sharing attributes
                low.register_post_accumulate_grad_hook(_into_master(p))
                module._parameters[name] = low
                seen[id(p)] = low
                self.slots.append((module, name, low, p))

    @torch.no_grad()
    def copy_to_model(self) -> None:
        lows = [s[2] for s in self.slots]
        masters = [s[3] for s in self.slots]
        if lows:
            torch._foreach_copy_(lows, masters)

    @contextmanager
    def fp32_view(self):
        """The masters stand in the model's parameter slots (checkpoint I/O sees fp32 weights
        and the optimizer's own parameter objects); the bf16 copies are refreshed after."""
        for module, name, _, master in self.slots:
            module._parameters[name] = master
        try:
            yield
        finally:
            for module, name, low, _ in self.slots:
                module._parameters[name] = low
            self.copy_to_model()


class PureLowPrecision:
    """Every parameter (and, once created, its AdamW state) in the low dtype; checkpoints still
    read and write fp32 tensors, so the format does not depend on the run's precision."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, dtype: torch.dtype) -> None:
        self.params = list({id(p): p for p in model.parameters()}.values())
        self.optimizer = optimizer
        self.dtype = dtype
        self._cast(dtype)

    def _cast(self, dtype: torch.dtype) -> None:
        for p in self.params:
            p.data = p.data.to(dtype)
            for k, v in self.optimizer.state.get(p, {}).items():
                if torch.is_tensor(v) and v.is_floating_point() and k != "step":
                    self.optimizer.state[p][k] = v.to(dtype)

    def copy_to_model(self) -> None:
        """Nothing to copy: the optimizer steps the parameters themselves."""

    @contextmanager
    def fp32_view(self):
        self._cast(torch.float32)
        try:
            yield
        finally:
            self._cast(self.dtype)


def _into_master(master: torch.nn.Parameter):
    def hook(low: torch.nn.Parameter) -> None:
        if master.grad is None:
            master.grad = low.grad.float()
        else:
            master.grad.add_(low.grad)
        low.grad = None

    return hook


def resolve_params_dtype(name: str, acc) -> torch.dtype:
    """`train.params_dtype`: auto is bf16 (with fp32 masters) where the accelerator computes in
    bf16, fp32 elsewhere."""
    from loongforge.core.errors import UserError

    if name == "auto":
        return torch.bfloat16 if acc.train_dtype() == torch.bfloat16 else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if name in ("float16", "fp16"):
        raise UserError("train.params_dtype=float16 needs loss scaling, which LoongForge does not do; use bfloat16 or float32")
    if name not in table:
        raise UserError(f"train.params_dtype={name!r}: choose auto, float32 or bfloat16")
    return table[name]
