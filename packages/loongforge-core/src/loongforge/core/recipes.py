"""Recipes, and the one `train` dispatch behind `loongforge train` and every package's alias.

A package registers each of its recipes under registry kind "recipe" from its plugin:

    from loongforge.core.recipes import Recipe, lazy

    PRETRAIN = Recipe("llm.pretrain", PretrainConfig, lazy("loongforge.llm.pretrain:run"), CONFIG_DIR,
                      aliases=("pretrain",), default=True)

    def register(reg):
        reg.add("recipe", PRETRAIN.name, PRETRAIN)

A recipe is named `<package>.<name>` (`llm.pretrain`, `llm.sft`, `vlm.sft`); its schema is the
run config dataclass, with a `recipe: str` field (the YAML's `recipe:` key, set to the qualified
name on load) and core's `checkpoint` section; `run(cfg)` trains and returns the final state
(`{"step": ...}`). `lazy("module:function")` imports the function on the first call, so
registering imports neither megatron-core nor transformers. `configs_dir` holds the package's
shipped YAMLs.

`train(config, overrides, prefer=None)` (`loongforge train`; a package's own CLI, such as
`loongforge-llm train`, passes `prefer="llm"`):
- `config` is a YAML path, or the name of a YAML shipped in any package's configs_dir (`tiny`
  is tiny.yaml). A name shipped by two packages must be qualified as `<package>/<name>`
  (`llm/tiny`); `prefer` (a package's own CLI) picks that package's on a tie.
- The recipe is the `recipe=` override, else the YAML's `recipe:` key (after its `defaults:`),
  else the default recipe of the config's package (`prefer` for a YAML path; a path used with
  `loongforge train` needs a `recipe:` key once two packages declare a default). A short name
  (`sft`, as older YAMLs say) is one of the package's recipes' `aliases`.
- Then `load_config(recipe.schema, path, overrides, search=[recipe.configs_dir, ...])` and
  `recipe.run(cfg)`; rank 0 prints `done: step N, run dir D`.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loongforge.core.errors import UserError


def lazy(target: str) -> Callable:
    """The function `module:function`, imported on its first call."""
    module, _, attr = target.partition(":")
    if not module or not attr:
        raise ValueError(f"lazy({target!r}): expected 'module:function'")

    def call(*args, **kwargs):
        return getattr(importlib.import_module(module), attr)(*args, **kwargs)

    call.__name__ = call.__qualname__ = target
    return call


@dataclass(frozen=True)
class Recipe:
    name: str  # <package>.<name>
    schema: type  # run config dataclass, with `recipe` and `checkpoint` fields
    run: Callable[[Any], dict]  # cfg -> final state
    configs_dir: Path | None = None  # the package's shipped YAMLs
    aliases: tuple[str, ...] = ()  # short names its package's configs may give as `recipe:`
    default: bool = False  # the recipe of its package's configs that name none

    def __post_init__(self) -> None:
        fields = {f.name for f in dataclasses.fields(self.schema)} if dataclasses.is_dataclass(self.schema) else set()
        if "." not in self.name or not {"recipe", "checkpoint"} <= fields:
            raise ValueError(f"recipe {self.name!r}: name it <package>.<name>; its schema is a dataclass with `recipe` and `checkpoint`")

    @property
    def package(self) -> str:
        return self.name.split(".", 1)[0]


def _registry(reg):
    if reg is None:
        from loongforge.core.registry import registry

        reg = registry()
    return reg


def recipes(reg=None) -> list[Recipe]:
    reg = _registry(reg)
    return [reg.get("recipe", n) for n in reg.names("recipe")]


def shipped_configs(reg=None) -> dict[str, dict[str, Path]]:
    """package -> config name -> YAML path, over every recipe's configs_dir."""
    out: dict[str, dict[str, Path]] = {}
    for r in recipes(reg):
        if r.configs_dir is not None:
            for p in sorted(Path(r.configs_dir).glob("*.yaml")):
                out.setdefault(r.package, {})[p.stem] = p
    return out


def find_config(name: str, reg=None, prefer: str | None = None) -> tuple[Path, str | None]:
    """(YAML path, package that ships it, or None for a path given as such)."""
    if Path(name).is_file():
        return Path(name), None
    shipped = shipped_configs(reg)
    stem = name.removesuffix(".yaml")
    package, _, bare = stem.rpartition("/")
    if bare in shipped.get(package, {}):
        return shipped[package][bare], package
    have = sorted(p for p in shipped if stem in shipped[p])
    if prefer in have or len(have) == 1:
        package = prefer if prefer in have else have[0]
        return shipped[package][stem], package
    if have:
        raise UserError(f"config {name!r} is shipped by several packages: name one of {', '.join(f'{p}/{stem}' for p in have)}")
    names = sorted({n for configs in shipped.values() for n in configs} | {f"{p}/{n}" for p, configs in shipped.items() for n in configs})
    close = difflib.get_close_matches(stem, names, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    if "/" in name or name.endswith((".yaml", ".yml")):
        raise UserError(f"config file not found: {name}{hint}")
    raise UserError(f"unknown config {name!r}{hint} (a YAML path or a shipped config: {', '.join(n for n in names if '/' not in n)})")


def find_recipe(name: str | None, package: str | None, reg=None) -> Recipe:
    """The recipe `name` (qualified, or an alias, looked up in `package` first), or with no name
    the default recipe of `package` (of every package when None)."""
    reg = _registry(reg)
    table = recipes(reg)
    if name is None:
        found = [r for r in table if r.default and package in (None, r.package)]
        if len(found) == 1:
            return found[0]
        raise UserError(f"the config names no recipe: add `recipe: NAME` (one of {', '.join(r.name for r in table)})")
    if name in reg.names("recipe"):
        return reg.get("recipe", name)
    for scope in ([package] if package else []) + [None]:
        found = [r for r in table if name in r.aliases and scope in (None, r.package)]
        if len(found) == 1:
            return found[0]
        if found:
            raise UserError(f"recipe {name!r} is ambiguous: write one of {', '.join(r.name for r in found)}")
    close = difflib.get_close_matches(name, reg.names("recipe") + [a for r in table for a in r.aliases], n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise UserError(f"unknown recipe {name!r}{hint} (registered: {', '.join(reg.names('recipe')) or 'none'})")


def resolve(config: str, overrides: Sequence[str] = (), prefer: str | None = None, reg=None) -> tuple[Recipe, Any]:
    """The recipe and the validated run config `train` would run."""
    from loongforge.core.config import load_config, read_yaml

    reg = _registry(reg)
    path, package = find_config(config, reg, prefer)
    home = package or prefer
    shipping = {(r.package, Path(r.configs_dir)) for r in recipes(reg) if r.configs_dir is not None}
    dirs = [d for _, d in sorted(shipping, key=lambda pd: (pd[0] != home, pd))]  # `home`'s first, for `defaults:`
    rest = [o for o in overrides if not o.startswith("recipe=")]
    wanted = [o.split("=", 1)[1] for o in overrides if o.startswith("recipe=")]
    named = wanted[-1] if wanted else read_yaml(path, dirs).get("recipe")
    recipe = find_recipe(None if named is None else str(named), home, reg)
    search = [Path(recipe.configs_dir)] if recipe.configs_dir is not None else []
    cfg = load_config(recipe.schema, path, [*rest, f"recipe={recipe.name}"], search=search + [d for d in dirs if d not in search])
    return recipe, cfg


def train(config: str, overrides: Sequence[str] = (), prefer: str | None = None) -> int:
    """Resolve `config`, run its recipe, print `done: step N, run dir D` on rank 0."""
    import torch.distributed as dist

    recipe, cfg = resolve(config, overrides, prefer)
    state = recipe.run(cfg)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"done: step {state['step']}, run dir {cfg.checkpoint.run_dir}")
    return 0
