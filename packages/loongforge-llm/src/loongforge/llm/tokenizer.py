"""The adapter megatron-core's GPT dataset expects around an HF tokenizer (pretraining data).
HF tokenizer loading lives in `loongforge.core.data.text`."""

from __future__ import annotations

from loongforge.core.data.text import eod_id


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
