"""HF tokenizers, and the adapter megatron-core's GPT dataset expects."""

from __future__ import annotations

from pathlib import Path

from loongforge.core.errors import UserError

TINY_TOKENIZER = Path(__file__).parent / "assets" / "tiny_tokenizer"


def resolve_tokenizer_path(path: str) -> Path:
    """`tiny` names the shipped demo tokenizer; anything else is an HF tokenizer directory."""
    if path == "tiny":
        return TINY_TOKENIZER
    p = Path(path)
    if not p.is_dir() or not any((p / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise UserError(f"tokenizer not found: {path} (need an HF tokenizer directory with tokenizer.json, or 'tiny')")
    return p


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    p = resolve_tokenizer_path(path)
    try:
        return AutoTokenizer.from_pretrained(str(p))
    except Exception as e:  # transformers raises many types for unreadable tokenizer files
        raise UserError(f"cannot load tokenizer from {p}: {str(e).splitlines()[0]}") from None


def eod_id(tok) -> int:
    eid = tok.eos_token_id
    if eid is None:
        raise UserError("the tokenizer defines no eos_token; pretraining needs one to separate documents")
    return int(eid)


def megatron_tokenizer(tok):
    """Wrap an HF tokenizer as megatron-core's `MegatronTokenizer`."""
    from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer as MegatronTokenizer

    class _Adapter(MegatronTokenizer):
        def __init__(self):
            super().__init__(tok.name_or_path, hf_tokenizer=type(tok).__name__)

        def tokenize(self, text):
            return tok(text, add_special_tokens=False)["input_ids"]

        def detokenize(self, ids):
            return tok.decode(ids)

        @property
        def vocab(self):
            return tok.get_vocab()

        @property
        def inv_vocab(self):
            return {v: k for k, v in tok.get_vocab().items()}

        @property
        def vocab_size(self):
            return len(tok)

        @property
        def eod(self):
            return eod_id(tok)

        @property
        def pad(self):
            return tok.pad_token_id if tok.pad_token_id is not None else eod_id(tok)

    return _Adapter()
