"""Rows of local text data files (jsonl/json/parquet/arrow/csv/txt), through `datasets`."""

from __future__ import annotations

from pathlib import Path

from loongforge.core.errors import UserError

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".txt": "text"}


def load_rows(inputs: list[str], streaming: bool = False):
    """Rows of local jsonl/json/parquet/arrow/csv/txt files or directories of them, through
    `datasets` (memory-mapped; `streaming` reads them lazily instead)."""
    import datasets

    files: list[str] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            files += sorted(str(f) for f in p.rglob("*") if f.suffix in FILE_FORMATS)
        elif p.is_file():
            files.append(str(p))
        else:
            raise UserError(f"data input not found: {item}")
    if not files:
        raise UserError(f"no data files (.jsonl/.json/.parquet/.arrow/.csv/.txt) under {', '.join(inputs)}")
    kinds = {FILE_FORMATS.get(Path(f).suffix) for f in files}
    if None in kinds or len(kinds) != 1:
        raise UserError(f"data files must share one supported format ({', '.join(FILE_FORMATS)}); got {sorted(map(str, kinds))}")
    # Reading files shows no bars (an error right after stays one line); tokenizing shows one.
    datasets.disable_progress_bars()
    try:
        return datasets.load_dataset(kinds.pop(), data_files=files, split="train", streaming=streaming)
    finally:
        datasets.enable_progress_bars()
