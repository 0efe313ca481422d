"""Resolve each op name to one implementation, once, when a model is built."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

from loongforge.core.errors import UserError
from loongforge.core.ops import reference

REFERENCE_OPS: dict[str, Callable] = {
    "rms_norm": reference.rms_norm,
    "add_rms_norm": reference.add_rms_norm,
    "gemma_rms_norm": reference.gemma_rms_norm,
    "rope": reference.rope,
    "qkv_rope": reference.qkv_rope,
    "rotary": reference.rotary,
    "swiglu": reference.swiglu,
    "geglu": reference.geglu,
    "layer_norm": reference.layer_norm,
    "gelu": reference.gelu,
    "attention": reference.attention,
    "varlen_attention": reference.varlen_attention,
    "packed_attention": reference.packed_attention,
    "linear_cross_entropy": reference.linear_cross_entropy,
    "moe_permute": reference.moe_permute,
    "moe_unpermute": reference.moe_unpermute,
    "moe_expert_mlp": reference.moe_expert_mlp,
    "adamw": reference.adamw,
    "sum_squares": reference.sum_squares,
}


@dataclass(frozen=True)
class OpImpl:
    """A registered implementation (registry kind "op", name `<op>.<impl>`): the function, the
    device types it runs on, and its rank among implementations for the same device (higher is
    faster, chosen by default). An implementation handles every dtype, falling back to the
    reference itself where it has no kernel."""

    fn: Callable
    devices: tuple[str, ...]
    priority: int = 0


@dataclass(frozen=True)
class OpTable:
    """An immutable op -> function mapping handed to the modules that use it (no global swap)."""

    impls: Mapping[str, Callable] = field(default_factory=lambda: dict(REFERENCE_OPS))

    def __getattr__(self, name: str) -> Callable:
        try:
            return self.impls[name]
        except KeyError:
            raise AttributeError(name) from None

    @classmethod
    def build(cls, choices: Mapping[str, str] | None = None, registry=None, device_type: str | None = None) -> "OpTable":
        """Each op's fastest registered implementation for `device_type` (the reference when none
        is registered, or no device is given); `choices` maps op name -> implementation name
        ("reference" or one a plugin registered as `<op>.<impl>` of kind "op") to override."""
        available: dict[str, dict[str, OpImpl]] = {}
        for key in registry.names("op") if registry is not None else []:
            op, impl = key.split(".", 1)
            available.setdefault(op, {})[impl] = registry.get("op", key)
        impls = dict(REFERENCE_OPS)
        for op, by_name in available.items():
            fit = [i for i in by_name.values() if device_type in i.devices]
            if op in impls and fit:
                impls[op] = max(fit, key=lambda i: i.priority).fn
        for op, impl in (choices or {}).items():
            if op not in REFERENCE_OPS:
                raise UserError(f"ops.{op}: unknown op; known ops: {', '.join(sorted(REFERENCE_OPS))}")
            if impl == "reference":
                impls[op] = REFERENCE_OPS[op]
                continue
            found = available.get(op, {}).get(impl)
            if found is None:
                have = ["reference"] + sorted(available.get(op, {}))
                raise UserError(f"ops.{op}={impl}: no such implementation installed; available: {', '.join(have)}")
            if device_type is not None and device_type not in found.devices:
                raise UserError(f"ops.{op}={impl} runs on {', '.join(found.devices)}, not {device_type}; use ops.{op}=reference")
            impls[op] = found.fn
        return cls(impls)

    def names(self) -> dict[str, str]:
        """op -> where its implementation lives (for logs)."""
        return {op: f"{fn.__module__}.{fn.__qualname__}" for op, fn in self.impls.items()}
