"""Load a dataclass schema from YAML files and `key=value` overrides, strictly."""

from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any, Iterable

import yaml
from loongforge.core.config.schema import validate_sections
from loongforge.core.errors import UserError
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException


def _read_yaml(path: Path, search: Iterable[Path], seen: tuple = ()) -> dict:
    if not path.is_file():
        raise UserError(f"config file not found: {path}")
    if path.resolve() in seen:
        raise UserError(f"{path}: circular `defaults:`")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise UserError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: top level must be a mapping")
    merged = OmegaConf.create()
    for base in data.pop("defaults", []) or []:
        cand = [path.parent / base] + [Path(s) / base for s in search]
        found = next((c for c in cand if c.is_file()), cand[0])
        merged = OmegaConf.merge(merged, _read_yaml(found, search, seen + (path.resolve(),)))
    return OmegaConf.to_container(OmegaConf.merge(merged, data))


def read_yaml(path: str | Path, search: Iterable[Path] = ()) -> dict:
    """A YAML file with its `defaults:` merged in, as a plain dict (no schema applied)."""
    return _read_yaml(Path(path), list(search))


def _check_keys(schema, data: Any, prefix: str = "") -> None:
    if not dataclasses.is_dataclass(schema) or not isinstance(data, dict):
        return
    fields = {f.name: f for f in dataclasses.fields(schema)}
    hints = typing.get_type_hints(schema)
    for k, v in data.items():
        if k not in fields:
            close = difflib.get_close_matches(str(k), list(fields), n=1, cutoff=0.5)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; valid keys: {', '.join(fields)}"
            raise UserError(f"unknown config key '{prefix}{k}'{hint}")
        sub = hints[k]
        if dataclasses.is_dataclass(sub):
            if not isinstance(v, dict):
                raise UserError(f"config key '{prefix}{k}' must be a mapping, got {v!r}")
            _check_keys(sub, v, f"{prefix}{k}.")
        elif typing.get_origin(sub) is dict and dataclasses.is_dataclass(typing.get_args(sub)[1]) and isinstance(v, dict):
            # a mapping of names to sections (parallel.components.<name>): every entry is checked
            for name, entry in v.items():
                if not isinstance(entry, dict):
                    raise UserError(f"config key '{prefix}{k}.{name}' must be a mapping, got {entry!r}")
                _check_keys(typing.get_args(sub)[1], entry, f"{prefix}{k}.{name}.")


def _parse_override(item: str) -> dict:
    if "=" not in item:
        raise UserError(f"override {item!r} is not key=value (example: train.lr=3e-4)")
    key, raw = item.split("=", 1)
    value = yaml.safe_load(raw) if raw != "" else None
    out: dict = {}
    cur = out
    parts = key.split(".")
    for p in parts[:-1]:
        cur = cur.setdefault(p, {})
    cur[parts[-1]] = value
    return out


def load_config(schema, path: str | Path | None = None, overrides: Iterable[str] = (), search: Iterable[Path] = ()):
    """Return a validated `schema` instance. Unknown keys name their path and the closest valid
    name; a value of the wrong type names the expected type; a `train`/`checkpoint` value out of
    range (`validate_sections`) names its key and the allowed range."""
    layers = [_read_yaml(Path(path), list(search))] if path else []
    layers += [_parse_override(o) for o in overrides]
    base = OmegaConf.structured(schema)
    for layer in layers:
        _check_keys(schema, layer)
        try:
            base = OmegaConf.merge(base, layer)
        except OmegaConfBaseException as e:
            key = getattr(e, "full_key", None) or "?"
            msg = str(e).splitlines()[0]
            raise UserError(f"config key '{key}': {msg}") from None
    cfg = OmegaConf.to_object(base)
    validate_sections(cfg)
    return cfg
