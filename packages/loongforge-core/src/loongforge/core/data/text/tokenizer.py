"""HF tokenizers: loading one (or the shipped demo tokenizer, `tiny`), its end-of-document id,
and copying its files next to a checkpoint."""

from __future__ import annotations

import shutil
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


def copy_tokenizer(src, dst) -> None:
    src, dst = Path(src), Path(dst)
    for f in src.iterdir():
        if f.is_file() and (
            f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja")
        ):
            shutil.copy2(f, dst / f.name)


def _has_tokenizer(d: Path) -> bool:
    return (d / "tokenizer.json").is_file() or (d / "tokenizer_config.json").is_file()


def tokenizer_dir_for(path) -> Path | None:
    """The tokenizer that goes with a model: an HF directory's own files, or a checkpoint's run
    `tokenizer/` directory, else the tokenizer its manifest's config names."""
    from loongforge.core.checkpoint import find_checkpoint, read_manifest
    from loongforge.core.foundation import hf_io

    p = Path(path)
    step = find_checkpoint(p) if not hf_io.is_hf_dir(p) else None
    if step is None:
        return p if _has_tokenizer(p) else None
    run_tok = step.parent.parent / "tokenizer"
    if _has_tokenizer(run_tok):
        return run_tok
    tok = read_manifest(step).get("config", {}).get("data", {}).get("tokenizer")
    if tok:
        try:
            return resolve_tokenizer_path(tok)
        except UserError:
            return None
    return None
