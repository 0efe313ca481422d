"""The embodied run config: core's shared sections, the policy's shape and the robot data."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List

from loongforge.core.config import CheckpointConfig, ParallelConfig, TrainConfig
from loongforge.core.foundation.lora import LoRAConfig
from loongforge.embodied.policies.pi0 import PiConfig

CONFIG_DIR = Path(__file__).parent / "configs"


@dataclass
class RobotDatasetConfig:
    root: str = "demo"  # a LeRobot dataset directory (v2.1 / v3.0), or "demo": the generated demo set, written into run_dir/data
    weight: float = 1.0


@dataclass
class RobotDataConfig:
    datasets: List[RobotDatasetConfig] = field(default_factory=lambda: [RobotDatasetConfig()])
    cameras: List[str] = field(default_factory=list)  # the policy's cameras, in order ([]: every camera of the first dataset)
    state_key: str = "observation.state"
    action_key: str = "action"
    tokenizer: str = "tiny"  # HF tokenizer directory (PaliGemma's for pretrained pi0 / pi0.5), or "tiny"
    max_prompt_tokens: int = 48  # prompts are padded (and cut) to this many tokens
    normalization: Dict[str, str] = field(
        default_factory=lambda: {"observation.state": "QUANTILES", "action": "QUANTILES"}
    )  # feature -> IDENTITY | MEAN_STD | MIN_MAX | QUANTILES | QUANTILE10 (pi0: MEAN_STD)
    augment: bool = False  # LeRobot's colour jitter and openpi's crop / rotation (not on wrist cameras)
    seed: int = 0  # the mixture's order and the augmentations


@dataclass
class PiRunConfig:
    recipe: str = "embodied.pi"
    policy: PiConfig = field(default_factory=PiConfig)
    data: RobotDataConfig = field(default_factory=RobotDataConfig)
    parallel: ParallelConfig = field(default_factory=lambda: ParallelConfig(stack="torch", data_parallel_mode="ddp"))
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    ops: dict = field(default_factory=dict)  # op name -> implementation
    # parts kept at their starting weights: vision, projector, backbone, expert (LeRobot's
    # freeze_vision_encoder is [vision]; its train_expert_only is [vision, projector, backbone])
    freeze: List[str] = field(default_factory=list)
    # lora.rank > 0: adapters on the targeted linears (globs over the policy's module names; the
    # default, every linear of the backbone's layers, is openpi's gemma_2b_lora); every other
    # weight of a part that holds adapters is frozen, as openpi's LoRA configs freeze it
    lora: LoRAConfig = field(default_factory=lambda: LoRAConfig(rank=0, alpha=16.0, target_modules=["backbone.layers.*"]))
