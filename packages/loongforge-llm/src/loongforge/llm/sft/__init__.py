"""The SFT recipe (`recipe: sft`, `sft/recipe.py`): conversation datasets tokenized with a chat
template (loss on assistant tokens), packed and trained through the setup every LLM recipe
shares, LoRA included. The data side (formats, chat templates, packing, prepacked and streaming
packs) lives in `loongforge.core.data.text`; its main names are re-exported here."""

from loongforge.core.data.text import BUILTIN_TEMPLATES, FORMATS, BadSample, SFTTokenizer, to_messages

__all__ = ["FORMATS", "BadSample", "to_messages", "BUILTIN_TEMPLATES", "SFTTokenizer"]
