"""Typed run configs: dataclass schemas, YAML composition (`defaults:`), `key=value` overrides
and strict validation."""

from loongforge.core.config.loader import load_config, read_yaml, to_dict
from loongforge.core.config.schema import CheckpointConfig, ParallelConfig, TrainConfig

__all__ = ["load_config", "read_yaml", "to_dict", "CheckpointConfig", "ParallelConfig", "TrainConfig"]
