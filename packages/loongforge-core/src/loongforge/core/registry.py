"""One registry for everything pluggable, filled from the `loongforge.plugins` entry points.

Each entry point names a function `register(registry)`. Kinds used today: "family" (decoder
families), "accelerator", "op" (`<op>.<impl>`), "recipe". Registering touches only this
registry, never another library's (no HF AutoModel registration).
"""

from __future__ import annotations

import difflib
from importlib.metadata import entry_points
from typing import Any

from loongforge.core.errors import UserError


class Registry:
    def __init__(self) -> None:
        self._items: dict[str, dict[str, Any]] = {}
        self.plugins: list[tuple[str, str]] = []  # (entry point name, distribution)

    def add(self, kind: str, name: str, obj: Any) -> None:
        table = self._items.setdefault(kind, {})
        if name in table and table[name] is not obj:
            raise ValueError(f"{kind} {name!r} registered twice")
        table[name] = obj

    def has(self, kind: str, name: str) -> bool:
        return name in self._items.get(kind, {})

    def get(self, kind: str, name: str) -> Any:
        table = self._items.get(kind, {})
        if name not in table:
            close = difflib.get_close_matches(name, list(table), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise UserError(f"unknown {kind} {name!r}{hint} (known: {', '.join(sorted(table)) or 'none'})")
        return table[name]

    def names(self, kind: str) -> list[str]:
        return sorted(self._items.get(kind, {}))

    def kinds(self) -> list[str]:
        return sorted(self._items)


_REGISTRY: Registry | None = None


def registry() -> Registry:
    """The process's registry, loaded from entry points on first use (read-only after)."""
    global _REGISTRY
    if _REGISTRY is None:
        reg = Registry()
        from loongforge.core.plugin import register as register_core

        register_core(reg)
        for ep in entry_points(group="loongforge.plugins"):
            if ep.value == "loongforge.core.plugin:register":
                continue
            ep.load()(reg)
            reg.plugins.append((ep.name, ep.dist.name if ep.dist else "?"))
        _REGISTRY = reg
    return _REGISTRY
