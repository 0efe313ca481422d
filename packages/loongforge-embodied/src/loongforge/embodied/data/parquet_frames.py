"""Rows of a LeRobot data parquet file as numpy values.

A file is read once (memory-mapped) and each column is turned into numpy on first use: numeric
scalars to a 1-d array, fixed-length lists (LeRobot's `Sequence(length=n)`, and the nested lists
of `Array2D`..`Array5D`) to an array of shape (rows, *feature shape); anything else (strings,
image structs) stays a list of Python values.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from loongforge.core.errors import UserError
from loongforge.embodied.data.lerobot_meta import require_file


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _is_numeric(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def column_to_numpy(column: pa.ChunkedArray | pa.Array, shape: Sequence[int] | None = None) -> np.ndarray | list:
    """One column as numpy when its rows are numbers or equal-size (nested) lists of numbers."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if isinstance(array.type, pa.ExtensionType):  # e.g. datasets' Array2D when `datasets` is imported
        array = array.storage
    if _is_numeric(array.type):
        return array.to_numpy(zero_copy_only=False)
    if _is_list(array.type) and array.null_count == 0:
        leaf, depth = array, 0
        while _is_list(leaf.type):
            leaf = leaf.flatten()
            depth += 1
        if isinstance(leaf.type, pa.ExtensionType):
            leaf = leaf.storage
        n = len(array)
        if _is_numeric(leaf.type) and leaf.null_count == 0 and n > 0 and len(leaf) % n == 0:
            per_row = len(leaf) // n
            values = leaf.to_numpy(zero_copy_only=False)
            if shape and math.prod(shape) == per_row:
                row_shape = tuple(shape)
            else:
                row_shape = np.asarray(array[0].as_py()).shape
            if math.prod(row_shape) == per_row and (depth == 1 or len(row_shape) == depth):
                try:
                    return values.reshape((n, *row_shape))
                except ValueError:
                    pass
        return [np.asarray(v) for v in array.to_pylist()]
    return array.to_pylist()


class DataFile:
    """The rows of one parquet file, by column."""

    def __init__(self, path: Path, features: dict[str, dict]):
        require_file(path, "episode data")
        try:
            self.table = pq.read_table(path, memory_map=True)
        except (OSError, ValueError) as e:
            raise UserError(f"{path}: cannot read as parquet: {e}") from None
        self.path = path
        self.features = features
        self.num_rows = self.table.num_rows
        self._columns: dict[str, np.ndarray | list] = {}

    def column(self, key: str) -> np.ndarray | list:
        if key not in self._columns:
            if key not in self.table.column_names:
                raise UserError(f"{self.path} has no column {key!r} (a feature in meta/info.json)")
            self._columns[key] = column_to_numpy(self.table.column(key), self.features.get(key, {}).get("shape"))
        return self._columns[key]

    def value(self, key: str, row: int) -> Any:
        """Row `row` of `key`: a numpy array (a copy) or scalar, or a Python value."""
        v = self.column(key)[row]
        return v.copy() if isinstance(v, np.ndarray) else v

    def values(self, key: str, rows: Sequence[int]) -> np.ndarray | list:
        """Rows `rows` of `key`, stacked along a new first axis where the column is numpy."""
        column = self.column(key)
        if isinstance(column, np.ndarray):
            return column[np.asarray(rows, dtype=np.int64)]
        return [column[r] for r in rows]
