"""What loongforge-llm registers: its recipes, pretraining (`llm.pretrain`, the default of its
shipped configs) and SFT (`llm.sft`), with the configs in `loongforge.llm.configs`. Older YAMLs
say `recipe: pretrain` / `recipe: sft`: the aliases. Registering imports neither megatron-core
nor transformers (the run functions are imported on first use)."""

from loongforge.core.recipes import Recipe, lazy
from loongforge.llm.config import CONFIG_DIR, PretrainConfig, SFTConfig

RECIPES = (
    Recipe("llm.pretrain", PretrainConfig, lazy("loongforge.llm.pretrain:run"), CONFIG_DIR, aliases=("pretrain",), default=True),
    Recipe("llm.sft", SFTConfig, lazy("loongforge.llm.sft.recipe:run"), CONFIG_DIR, aliases=("sft",)),
)


def register(reg) -> None:
    for recipe in RECIPES:
        reg.add("recipe", recipe.name, recipe)
