"""Output directories: a command that writes a new directory never writes into a user's
non-empty one (every converter, exporter and preprocessor checks through this)."""

from __future__ import annotations

from pathlib import Path

from loongforge.core.errors import UserError


def require_new_dir(path) -> Path:
    """`path` as a Path, if it does not exist or is an empty directory; else a UserError."""
    out = Path(path)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out}: output directory exists and is not empty; choose a new one")
    return out
