"""One registry for everything pluggable, filled from the `loongforge.plugins` entry points.

Each entry point names a function `register(registry)`; loongforge-core registers its own
families and accelerators through its entry point like every other package. Kinds used today:
"family" (decoder families), "accelerator", "op" (`<op>.<impl>`), "recipe" (a
`loongforge.core.recipes.Recipe`, named `<package>.<name>`). Registering touches only this
registry, never another library's (no HF AutoModel registration), and imports neither
megatron-core nor transformers.
"""

from __future__ import annotations

import difflib
from importlib.metadata import entry_points
from typing import Any

from loongforge.core.errors import UserError


class Registry:
    def __init__(self) -> None:
        self._items: dict[str, dict[str, Any]] = {}
        self._origin: dict[tuple[str, str], str] = {}
        self.source = "?"  # the distribution whose plugin is registering: each added item's origin

    def add(self, kind: str, name: str, obj: Any) -> None:
        table = self._items.setdefault(kind, {})
        if name in table and table[name] is not obj:
            raise ValueError(f"{kind} {name!r} registered twice")
        table[name] = obj
        self._origin[(kind, name)] = self.source

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

    def origin(self, kind: str, name: str) -> str:
        """The distribution whose plugin registered `name` ("?" when added by hand)."""
        return self._origin.get((kind, name), "?")


_REGISTRY: Registry | None = None


def registry() -> Registry:
    """The process's registry, loaded from entry points on first use (read-only after)."""
    global _REGISTRY
    if _REGISTRY is None:
        reg = Registry()
        for ep in sorted(entry_points(group="loongforge.plugins"), key=lambda e: e.name):
            reg.source = ep.dist.name if ep.dist else ep.name
            ep.load()(reg)
        reg.source = "?"
        _REGISTRY = reg
    return _REGISTRY
