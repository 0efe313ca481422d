"""What loongforge-diffusion registers: the `diffusion.wan` recipe (the default of its shipped
configs) and `diffusion.qwen_image`. Registering imports neither the models nor the data tools."""

from loongforge.core.recipes import Recipe, lazy
from loongforge.diffusion.config import CONFIG_DIR, QwenImageRunConfig, WanRunConfig

RECIPES = (
    Recipe("diffusion.wan", WanRunConfig, lazy("loongforge.diffusion.recipe:run"), CONFIG_DIR, aliases=("wan",), default=True),
    Recipe("diffusion.qwen_image", QwenImageRunConfig, lazy("loongforge.diffusion.recipe:run"), CONFIG_DIR, aliases=("qwen_image",)),
)


def register(reg) -> None:
    for recipe in RECIPES:
        reg.add("recipe", recipe.name, recipe)
