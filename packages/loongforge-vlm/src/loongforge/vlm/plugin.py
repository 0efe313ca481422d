"""What loongforge-vlm registers: the `vlm.sft` recipe (the default of its shipped configs).
Registering imports neither the model nor the data tools."""

from loongforge.core.recipes import Recipe, lazy
from loongforge.vlm.config import CONFIG_DIR, VLMRunConfig

SFT = Recipe("vlm.sft", VLMRunConfig, lazy("loongforge.vlm.recipe:run"), CONFIG_DIR, default=True)


def register(reg) -> None:
    reg.add("recipe", SFT.name, SFT)
