"""SFT packs made while training consumes them: rows read lazily, tokenized and packed within a
buffer of `stream_buffer` samples (no pass over the data before step 1)."""

from __future__ import annotations

import itertools
import random
from typing import Iterator

from loongforge.core.data import Pack
from loongforge.core.data.text.packs import as_sample, check_datasets, make_packs, pad_id, sft_rows, sft_tokenizer
from loongforge.core.errors import UserError


def stream_packs(d, tok, seed: int) -> Iterator[Pack]:
    """Packs made as they are needed: rows drawn from the datasets by weight (each read lazily,
    shuffled in a buffer, restarting with a new order when it runs out), tokenized, and packed
    best-fit decreasing within every `stream_buffer` samples. Deterministic for a seed."""
    check_datasets(d)
    st = sft_tokenizer(d, tok)
    rng = random.Random(seed)

    def endless(ds, k):
        for epoch in itertools.count():
            rows = sft_rows(ds.path, streaming=True).shuffle(seed=seed + 1000 * k + epoch, buffer_size=max(d.stream_buffer, 1))
            got = 0
            for s in st.tokenize_rows(rows, ds.format, ds.keys, d.on_bad_sample, require_trained=False):
                got += 1
                yield as_sample(s)
            if got == 0:
                raise UserError(f"data.datasets {ds.path}: no usable rows (bad rows: {dict(st.stats)})")

    sources = [endless(ds, k) for k, ds in enumerate(d.datasets)]
    weights = [ds.weight for ds in d.datasets]
    pad = pad_id(tok)
    trained_any = False
    while True:
        buf = [next(sources[rng.choices(range(len(sources)), weights)[0]]) for _ in range(d.stream_buffer)]
        trained_any = trained_any or any(bool(s["loss_mask"].any()) for s in buf)
        if not trained_any:
            raise UserError(
                f"no sample in the first {d.stream_buffer} streamed rows has a token to train on (all labels masked); bad rows: {dict(st.stats)}"
            )
        packs, _ = make_packs(buf, d, pad)
        rng.shuffle(packs)
        yield from packs
