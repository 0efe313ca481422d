"""Typed run configs: dataclass schemas, YAML composition (`defaults:`), `key=value` overrides
and strict validation."""

from loongforge.core.config.loader import load_config, to_dict
from loongforge.core.config.schema import CheckpointConfig, ParallelConfig, TrainConfig

__all__ = ["load_config", "to_dict", "CheckpointConfig", "ParallelConfig", "TrainConfig"]
