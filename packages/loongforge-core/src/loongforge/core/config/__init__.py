"""Typed run configs: dataclass schemas, YAML composition (`defaults:`), `key=value` overrides
and strict validation."""

from loongforge.core.config.loader import load_config, read_yaml
from loongforge.core.config.schema import CheckpointConfig, ParallelConfig, TrainConfig

__all__ = ["load_config", "read_yaml", "CheckpointConfig", "ParallelConfig", "TrainConfig"]
