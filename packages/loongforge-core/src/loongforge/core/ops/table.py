"""Resolve each op name to one implementation, once, when a model is built."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

from loongforge.core.errors import UserError
from loongforge.core.ops import reference

REFERENCE_OPS: dict[str, Callable] = {
    "rms_norm": reference.rms_norm,
    "rope": reference.rope,
    "swiglu": reference.swiglu,
    "attention": reference.attention,
    "varlen_attention": reference.varlen_attention,
    "cross_entropy": reference.cross_entropy,
}


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
    def build(cls, choices: Mapping[str, str] | None = None, registry=None) -> "OpTable":
        """`choices` maps op name -> implementation name ("reference" or one a plugin registered
        as `<op>.<impl>` of kind "op")."""
        impls = dict(REFERENCE_OPS)
        for op, impl in (choices or {}).items():
            if op not in REFERENCE_OPS:
                raise UserError(f"ops.{op}: unknown op; known ops: {', '.join(sorted(REFERENCE_OPS))}")
            if impl == "reference":
                continue
            key = f"{op}.{impl}"
            if registry is None or not registry.has("op", key):
                have = ["reference"] + [k.split(".", 1)[1] for k in (registry.names("op") if registry else []) if k.startswith(op + ".")]
                raise UserError(f"ops.{op}={impl}: no such implementation installed; available: {', '.join(have)}")
            impls[op] = registry.get("op", key)
        return cls(impls)
