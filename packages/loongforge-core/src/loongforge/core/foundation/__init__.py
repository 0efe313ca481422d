"""Decoder backbones shared by every modality: family specs, the megatron-core builder, HF
mapping tables and HF directory I/O."""

from loongforge.core.foundation.model import CausalLM
from loongforge.core.foundation.spec import FamilySpec, ModelConfig, build_gpt_model

__all__ = ["FamilySpec", "ModelConfig", "build_gpt_model", "CausalLM"]
