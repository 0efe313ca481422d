"""loongforge.core: what every LoongForge stack shares.

Config schemas and YAML composition, the plugin registry, accelerator backends, the
per-component parallel context, the op table, decoder backbones (foundation), the checkpoint
layout and the training loop.
"""

from loongforge.core.errors import UserError

__version__ = "0.1.0"
__all__ = ["UserError", "__version__"]
