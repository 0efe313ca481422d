"""Supervised fine-tuning data: conversation formats, chat templates with assistant-only loss
masks, and bad-sample accounting. (Training wiring, packing into the trainer and LoRA are still
to come: see docs/status.md.)"""

from loongforge.llm.sft.formats import FORMATS, BadSample, to_messages
from loongforge.llm.sft.templates import BUILTIN_TEMPLATES, SFTTokenizer

__all__ = ["FORMATS", "BadSample", "to_messages", "BUILTIN_TEMPLATES", "SFTTokenizer"]
