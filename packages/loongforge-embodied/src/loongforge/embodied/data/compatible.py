"""Datasets mixed for one policy must agree on the features it reads."""

from __future__ import annotations

from typing import Sequence

from loongforge.core.data.mixture import dataset_name as _name
from loongforge.core.errors import UserError


def check_compatible(datasets: Sequence, keys: Sequence[str]) -> None:
    """A UserError naming the key and the dataset (by its root) when a dataset lacks one of `keys`
    or has it with another shape than the first dataset that has it."""
    keys = [keys] if isinstance(keys, str) else list(keys)
    for key in keys:
        ref = None
        for i, ds in enumerate(datasets):
            feature = ds.features.get(key)
            if feature is None:
                raise UserError(f"{_name(ds, i)}: no feature {key!r}, which the policy reads (it has: {', '.join(ds.features)})")
            shape = list(feature.get("shape") or [])
            if ref is None:
                ref = (i, shape)
            elif shape != ref[1]:
                raise UserError(
                    f"{_name(ds, i)}: feature {key!r} has shape {shape}, {_name(datasets[ref[0]], ref[0])} has {ref[1]} "
                    "(datasets mixed for one policy must agree)"
                )
