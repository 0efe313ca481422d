"""Encoding a stream of records into training samples, counting the bad ones by reason.

    samples, bad = encode_all(read_records(["data/llava.json"]), encoder)   # bad: Counter({"missing_media": 2})

Everything is held in memory (a list of sample dicts), which suits demo and small fine-tuning sets.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable

from loongforge.core.data.text import BadSample
from loongforge.core.errors import UserError
from loongforge.vlm.data.formats import VisionRecord

ON_BAD_SAMPLE = ("skip", "error")


def encode_all(records: Iterable, encoder, on_bad_sample: str = "skip", progress: bool = True) -> tuple[list[dict], Counter]:
    """(samples, Counter of bad records by reason) of `records`: VisionRecords, and BadSamples
    (what `read_records` yields for rows it could not read), each encoded by `encoder`
    (`VisionSampleEncoder.encode` or any record -> dict callable). `on_bad_sample="error"`: the
    first bad record raises a UserError naming it and its reason. A UserError too when records
    were given and none could be encoded. `progress` shows a bar."""
    from tqdm import tqdm

    if on_bad_sample not in ON_BAD_SAMPLE:
        raise UserError(f"on_bad_sample={on_bad_sample!r}: choose skip or error")
    encode = encoder.encode if hasattr(encoder, "encode") else encoder
    total = len(records) if hasattr(records, "__len__") else None
    samples: list[dict] = []
    bad: Counter = Counter()
    seen = 0
    for n, item in enumerate(tqdm(records, total=total, desc="encode", unit="sample", mininterval=1.0, disable=not progress)):
        seen += 1
        where = getattr(item, "where", "") or f"record {n}"
        try:
            if isinstance(item, BadSample):
                raise item
            if not isinstance(item, VisionRecord):
                raise TypeError(f"encode_all takes VisionRecords (or BadSamples), got {type(item).__name__}")
            samples.append(encode(item))
        except BadSample as e:
            bad[e.reason] += 1
            if on_bad_sample == "error":
                raise UserError(f"{where}: {e} (set on_bad_sample=skip to drop such records)") from None
    if seen and not samples:
        raise UserError(f"none of the {seen} records could be encoded; bad records by reason: {dict(bad)}")
    return samples, bad
