"""Vision-language-action policies: pi0 and pi0.5 (`PiPolicy`, one module, `PiConfig.variant`)."""

from loongforge.embodied.policies.pi0 import Observation, PiConfig, PiPolicy, block_mask, time_embedding

__all__ = ["Observation", "PiConfig", "PiPolicy", "block_mask", "time_embedding"]
