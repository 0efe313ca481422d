"""Vision-language SFT records: rows of LLaVA-style JSON, sharegpt / openai messages (JSON or
JSONL) and parquet files -> `VisionRecord`, one normalized type.

    for item in read_records(["data/llava.json"], media_root="data/images"):
        ...  # a VisionRecord, or the BadSample of a row that cannot be used

A `VisionRecord` holds chat messages whose content is a list of parts in order, each
`{"type": "text", "text": str}`, `{"type": "image"}` or `{"type": "video"}` (what Qwen2-VL-style
chat templates take), the image sources in the order of the image parts, and the video sources
likewise. A source is an absolute file path (str) or the file's bytes.

Where media come from in a row (any mix):
- a content part that carries its source: `{"type": "image", "image": path}`,
  `{"type": "image_url", "image_url": {"url": path or data: URI}}` (or the url as a string),
  `{"type": "video", "video": path}`, also under the keys "url" / "path", or as
  `{"bytes": ..., "path": ...}` (HF datasets' Image feature);
- a placeholder, `<image>` / `<video>` in a text (LLaVA), or a part without a source
  (`{"type": "image"}`, as HF datasets' chat columns hold them): filled in order from the row's
  `image` / `images` (`video` / `videos`) key, a path, bytes, a {"bytes", "path"} struct or a list
  of them. Their numbers must be equal: else BadSample("placeholder_mismatch").

Rows are read as core's text formats read them (`loongforge.core.data.text.to_messages`: roles,
system prompts, tool calls, the checks on assistant turns), picked per row with `fmt="auto"`: a
row whose turns have "from" / "value" (LLaVA, sharegpt) as `sharegpt`, one with "role" /
"content" as `openai`, under the key "conversations" or "messages". Relative paths are resolved
against `media_root`, or else the data file's directory; a file that is not there is
BadSample("missing_media"); an http(s) URL is BadSample("remote_media") (nothing is
downloaded); a data: URI that is not base64 is BadSample("corrupt_media"). Whether a file
decodes is found when it is encoded (`encode.VisionSampleEncoder`: "corrupt_media").

Files are read directly (json, pyarrow), not through `datasets` (`core.data.text.load_rows`):
LLaVA rows mix shapes (a path or a list of paths, text-only rows without the key) that a
table's schema refuses, and `datasets` would decode an Image column into PIL images.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Union

from loongforge.core.data.text import BadSample, to_messages
from loongforge.core.errors import UserError

Source = Union[str, bytes]

FILE_SUFFIXES = (".json", ".jsonl", ".parquet")
FORMATS = ("auto", "llava", "sharegpt", "openai")  # llava: sharegpt's keys (conversations / from / value)
MARKERS = {"image": "<image>", "video": "<video>"}
TEXT_PART_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}
MEDIA_PARTS = {"image": "image", "input_image": "image", "image_url": "image", "video": "video", "video_url": "video"}
# where a part keeps its source, by kind
PART_SOURCE_KEYS = {"image": ("image", "image_url", "url", "path"), "video": ("video", "video_url", "url", "path")}
ROW_MEDIA_KEYS = {"image": ("images", "image"), "video": ("videos", "video")}
# Stand-ins for media while core's format readers see the row as text (Unicode private use).
_SLOT = {"image": "\ue000", "video": "\ue001"}
_KIND = {v: k for k, v in _SLOT.items()}


@dataclass
class VisionRecord:
    """One conversation: `messages` ([{"role", "content": [parts]} ...], see the module docstring),
    `images` / `videos` (sources in the order of their parts: absolute paths or bytes; a record
    built in code may also hold PIL images), `tools` (OpenAI tool schemas or None), and `where`
    it came from (file and row; not compared)."""

    messages: list[dict]
    images: list[Source] = field(default_factory=list)
    videos: list[Source] = field(default_factory=list)
    tools: list[dict] | None = None
    where: str = field(default="", compare=False)


# ---- reading files -----------------------------------------------------------------------------


def data_files(paths: Iterable) -> list[Path]:
    """The data files of `paths` (files, or directories searched for .json / .jsonl / .parquet)."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    files: list[Path] = []
    for item in paths:
        p = Path(item)
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.suffix in FILE_SUFFIXES and f.is_file())
        elif p.is_file():
            if p.suffix not in FILE_SUFFIXES:
                raise UserError(f"{p}: not a vision-language data file ({', '.join(FILE_SUFFIXES)})")
            files.append(p)
        else:
            raise UserError(f"data input not found: {p}")
    if not files:
        raise UserError(f"no data files ({', '.join(FILE_SUFFIXES)}) under {', '.join(map(str, paths))}")
    return files


def _rows(path: Path) -> Iterator[tuple[int, object]]:
    """(row number, row) of one file; a JSONL line that is not JSON is BadSample("bad_json") in
    place of its row."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.ParquetFile(str(path))
        except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ...
            raise UserError(f"{path}: cannot read as parquet: {str(e).splitlines()[0]}") from None
        n = 0
        for batch in table.iter_batches(batch_size=64):
            for row in batch.to_pylist():
                yield n, row
                n += 1
    elif path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f):
                if not line.strip():
                    continue
                try:
                    yield n, json.loads(line)
                except json.JSONDecodeError as e:
                    yield n, BadSample("bad_json", str(e))
    else:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"{path}: not a JSON file: {e}") from None
        if not isinstance(data, list):
            raise UserError(f"{path}: a JSON data file holds a list of rows, got {type(data).__name__}")
        yield from enumerate(data)


def read_records(paths, fmt: str = "auto", media_root=None, keys: dict | None = None) -> Iterator[VisionRecord | BadSample]:
    """Each row of the data files under `paths` (a path or a list of them) as a VisionRecord, or,
    for a row that cannot be used, its BadSample (not raised; its `where` names the row).
    `media_root`: where relative media paths start (default: each data file's directory);
    `keys`: core's key overrides of the format (e.g. {"messages": "dialog"})."""
    if fmt not in FORMATS:
        raise UserError(f"unknown vision-language data format {fmt!r}; choose one of {', '.join(FORMATS)}")
    for path in data_files(paths):
        root = Path(media_root) if media_root is not None else path.parent
        for n, row in _rows(path):
            where = f"{path}[{n}]"
            if isinstance(row, dict) and row.get("id") not in (None, ""):
                where += f" (id {row['id']})"
            if isinstance(row, BadSample):
                row.where = where
                yield row
                continue
            try:
                yield to_record(row, fmt, root, keys, where)
            except BadSample as e:
                e.where = where
                yield e


# ---- one row -----------------------------------------------------------------------------------


def to_record(row, fmt: str = "auto", root=None, keys: dict | None = None, where: str = "") -> VisionRecord:
    """The VisionRecord of one row (`root`: where relative media paths start, default the current
    directory); raises BadSample for a row that cannot be used."""
    if not isinstance(row, dict):
        raise BadSample("bad_row", f"a row is {type(row).__name__}, expected an object")
    root = Path(root) if root is not None else Path(".")
    text_fmt, keys = _format(row, fmt, keys or {})
    turns_key = keys["messages"]
    content_key = keys.get("content", "value" if text_fmt == "sharegpt" else "content")
    turns = row.get(turns_key)
    if not isinstance(turns, list) or not turns:
        raise BadSample("missing_field", turns_key)
    slots: list[tuple[str, object]] = []  # (kind, source or None) in the order of appearance
    text_turns = []
    for i, turn in enumerate(turns):
        if isinstance(turn, dict) and content_key in turn:
            turn = {**turn, content_key: _as_text(turn[content_key], f"{turns_key}[{i}]", slots)}
        text_turns.append(turn)
    conv = to_messages({**row, turns_key: text_turns}, text_fmt, keys)
    sources = _fill(slots, row)
    messages = [{**m, "content": _as_parts(m.get("content"))} for m in conv.messages]
    kinds = [_KIND[c] for m in conv.messages for c in (m.get("content") or "") if c in _KIND]
    if kinds != [k for k, _ in slots]:  # core's readers keep every turn's text as it is
        raise BadSample("placeholder_mismatch", "the media parts did not survive reading the row's messages")
    images = [_resolve(s, root, "image") for k, s in zip(kinds, sources) if k == "image"]
    videos = [_resolve(s, root, "video") for k, s in zip(kinds, sources) if k == "video"]
    return VisionRecord(messages, images, videos, conv.tools, where)


def _format(row: dict, fmt: str, keys: dict) -> tuple[str, dict]:
    """(core's text format, its keys) for a row."""
    if fmt in ("sharegpt", "llava"):
        return "sharegpt", {"messages": "conversations", "role": "from", "content": "value", **keys}
    if fmt == "openai":
        return "openai", {"messages": "messages", **keys}
    turns_key = keys.get("messages") or next((k for k in ("conversations", "messages") if k in row), "messages")
    turns = row.get(turns_key)
    first = turns[0] if isinstance(turns, list) and turns and isinstance(turns[0], dict) else {}
    if "from" in first or "value" in first:
        role, content = ("from" if "from" in first else "role"), ("value" if "value" in first else "content")
        return "sharegpt", {"role": role, "content": content, **keys, "messages": turns_key}
    return "openai", {**keys, "messages": turns_key}


def _as_text(content, where: str, slots: list) -> object:
    """A turn's content with each medium replaced by its stand-in character (recorded in `slots`);
    content that is neither text nor a list of parts is left for core's reader to judge."""
    if isinstance(content, str):
        return _markers(content, slots)
    if not isinstance(content, list):
        return content
    out = []
    for part in content:
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise BadSample("bad_field_type", f"{where}: a content part must be an object with a type")
        kind = part["type"]
        if kind in TEXT_PART_KEYS:
            text = part.get(TEXT_PART_KEYS[kind])
            if not isinstance(text, str):
                raise BadSample("bad_field_type", f"{where}: a {kind} part's text is {type(text).__name__}, expected str")
            out.append(_markers(text, slots))
        elif kind in MEDIA_PARTS:
            medium = MEDIA_PARTS[kind]
            source = next((part[k] for k in PART_SOURCE_KEYS[medium] if part.get(k) is not None), None)
            slots.append((medium, source))
            out.append(_SLOT[medium])
        else:
            raise BadSample("unsupported_content", f"{where}: a {kind} part")
    return "".join(out)


def _markers(text: str, slots: list) -> str:
    if any(c in text for c in _KIND):
        raise BadSample("bad_field_type", "the text holds a Unicode private-use character U+E000 / U+E001 that marks media here")
    pieces = []
    i = 0
    while True:
        found = [(text.find(m, i), kind) for kind, m in MARKERS.items()]
        found = [(at, kind) for at, kind in found if at >= 0]
        if not found:
            pieces.append(text[i:])
            return "".join(pieces)
        at, kind = min(found)
        pieces += [text[i:at], _SLOT[kind]]
        slots.append((kind, None))
        i = at + len(MARKERS[kind])


def _row_media(row: dict, kind: str) -> list:
    for key in ROW_MEDIA_KEYS[kind]:
        v = row.get(key)
        if v is None or (isinstance(v, str) and not v):  # "": a text-only row of a table with the column
            continue
        return list(v) if isinstance(v, (list, tuple)) else [v]
    return []


def _fill(slots: list, row: dict) -> list:
    """The sources of the slots, those without one taken in order from the row's media keys."""
    out = []
    for kind in ("image", "video"):
        given = _row_media(row, kind)
        wanted = sum(1 for k, s in slots if k == kind and s is None)
        if wanted != len(given):
            marker = MARKERS[kind]
            raise BadSample(
                "placeholder_mismatch", f"{wanted} {marker} placeholders (or {kind} parts without a source) for {len(given)} {kind}s"
            )
    queues = {kind: iter(_row_media(row, kind)) for kind in ("image", "video")}
    for kind, source in slots:
        out.append(source if source is not None else next(queues[kind]))
    return out


def _as_parts(content) -> list[dict]:
    """Text with stand-ins -> [{"type": "text", "text"} | {"type": "image"} | {"type": "video"}]."""
    parts: list[dict] = []
    text = []
    for c in content or "":
        if c in _KIND:
            if text:
                parts.append({"type": "text", "text": "".join(text)})
                text = []
            parts.append({"type": _KIND[c]})
        else:
            text.append(c)
    if text:
        parts.append({"type": "text", "text": "".join(text)})
    return parts


def _resolve(source, root: Path, kind: str) -> Source:
    """A source as bytes or an absolute path of a file that exists."""
    if isinstance(source, dict):  # {"bytes", "path"} (HF datasets' Image) or {"url"} (OpenAI's image_url)
        if source.get("bytes") is not None:
            return _resolve(source["bytes"], root, kind)
        inner = next((source[k] for k in ("url", "path") if source.get(k) is not None), None)
        if inner is None:
            raise BadSample("bad_field_type", f"an {kind} source has neither bytes, url nor path")
        return _resolve(inner, root, kind)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    if not isinstance(source, str) or not source:
        raise BadSample("bad_field_type", f"an {kind} source is {type(source).__name__}, expected a path, URL or bytes")
    if source.startswith("data:"):
        head, _, payload = source.partition(",")
        if not head.endswith(";base64"):
            raise BadSample("corrupt_media", f"a data: URI of an {kind} that is not base64")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise BadSample("corrupt_media", f"a data: URI of an {kind} with bad base64") from None
    if source.startswith(("http://", "https://")):
        raise BadSample("remote_media", f"{source} (media are not downloaded; fetch them and give paths)")
    path = Path(source.removeprefix("file://")).expanduser()
    path = path if path.is_absolute() else root / path
    if not path.is_file():
        raise BadSample("missing_media", f"{path}: no such file")
    return str(path.resolve())
