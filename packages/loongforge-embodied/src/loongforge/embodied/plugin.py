"""What loongforge-embodied registers: the `embodied.pi` recipe (pi0 / pi0.5), the default of its
shipped configs. Registering imports neither torch models nor the data readers."""

from loongforge.core.recipes import Recipe, lazy
from loongforge.embodied.config import CONFIG_DIR, PiRunConfig

RECIPES = (Recipe("embodied.pi", PiRunConfig, lazy("loongforge.embodied.recipe:run"), CONFIG_DIR, aliases=("pi",), default=True),)


def register(reg) -> None:
    for recipe in RECIPES:
        reg.add("recipe", recipe.name, recipe)
