"""Preprocessing a captioned video / image set into VAE latents and text embeddings, once, so that
training never runs the frozen encoders; and `LatentDataset`, which reads the result.

    summary = preprocess(Path("data/clips"), Path("data/latents"), vae_spec="tiny", text_spec="tiny",
                         buckets=parse_buckets(["32x32x9", "32x32x1"]), fps=8)
    ds = LatentDataset(Path("data/latents"))      # ds.get(i) -> {"latents", "text", "caption"}

The source is a folder with `captions.jsonl` (one JSON object a line: "video" or "image", and
"caption") or `metadata.csv` (columns `video` or `image`, and `caption`); paths are relative to
the folder (absolute ones are used as they are). An entry is a video (.mp4 .mkv .webm .mov) or an
image (.png .jpg .jpeg .webp) by its file's extension. Each sample is read (a video sampled at
`fps`, `media.read_video`; an image as one frame), given a bucket (`buckets.choose_bucket`: a
video among the buckets of more than one frame, or among all buckets if none has more; an image
among those of one frame), cut to the bucket's frames, resized and centre-cropped to it
(`media.resize_crop`), encoded by the VAE (`encoders.encode_video`) and its caption by the text
encoder (`encoders.encode_text`, one caption at a time, so a sample's embedding never depends on
its neighbours).

`family` picks the frozen encoders' family ("wan", the default, or "qwen_image": see
`encoders`): the tiny models of "tiny" specs, and how captions become text states. Qwen-Image
trains on images: every bucket must have 1 frame (sides divisible by 16, as for every bucket: the
8x VAE, then 2 x 2 packing), another is refused with a UserError naming it; videos are then read as
their first frame (the rule above: with no bucket of more than one frame, a video chooses among all
buckets, so it is cut to 1 frame).

Bad samples are counted by reason and skipped (`on_bad_sample="skip"`), or raise a UserError
naming the file and the reason (`"error"`): "missing" (no such file), "corrupt" (does not decode),
"too_short" (fewer frames than every bucket it could use), "empty_caption" (nothing left after
Wan's prompt cleaning, for either family), "unsupported" (an extension that is neither a video nor an image).

Output layout:

    out/meta.json               {"format": "loongforge-diffusion-latents", "version": 1, "vae",
                                 "text_encoder", "latent_channels", "text_dim", "buckets",
                                 "source", "fps", "samples", "shards": [{"name", "samples"}],
                                 "bad": {reason: count}, and "family" unless it is "wan"};
                                 written last: its presence marks a complete output
    out/shards/00000.safetensors  tensors latents.{j} [C, F', H', W'] and text.{j} [L, D] for
                                  each sample j (0, 1, ... within the shard), in the encoders' dtype
    out/shards/00000.json         {"samples": [{"caption", "source", "entry", "bucket",
                                  "latent_shape", "text_length"}, ...]}
    out/progress.json           {"settings", "entries_done", "shards", "samples", "bad",
                                 "complete"}

Wan2.1 image-to-video (`image_spec`, a CLIP vision encoder: see `encoders`): each sample also
gets its condition latents, the VAE latents of its first frame followed by zeros
(`WanImageToVideoPipeline.prepare_latents`' `video_condition`, `encoders.condition_video`), and
its first frame's CLIP features (`encoders.encode_image`, the penultimate hidden states of the
frame as the VAE sees it), stored as `condition.{j}` [C, F', H', W'] and `image.{j}` [tokens,
image_dim] beside the others; meta.json then records "image_encoder" and "image_dim" (and the
settings "image_encoder", so a resumed run must use the same one). The mask channels are not
stored: they follow from the latent shape (`encoders.first_frame_mask`).

"family" is recorded (in meta.json and in the settings a resumed run must match) only when it is
not "wan", so Wan outputs are byte-identical to those written before families existed and resume
as before; a reader takes a missing "family" as "wan" (`LatentDataset.family`).

Every file is written to a temporary name and renamed into place (`<name>.tmp-<pid>`), a shard
before the progress that counts it. An interrupted run, started again with the same source and
settings, continues after the last complete shard (entries after it are read again) and ends with
the output an uninterrupted run writes; a complete one is left as it is. A non-empty `out` that is
not an earlier run of the same source file (its sha256) and settings is refused with a UserError
and left untouched.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from loongforge.core.checkpoint.layout import write_durable
from loongforge.core.errors import UserError
from loongforge.diffusion.data.buckets import Bucket, choose_bucket, parse_buckets
from loongforge.diffusion.data.encoders import (
    DEFAULT_MAX_LENGTH,
    check_family,
    check_text_encoder,
    clean_caption,
    condition_video,
    encode_image,
    encode_text,
    encode_video,
    frame_image,
    image_dim,
    load_image_encoder,
    load_text_encoder,
    load_vae,
    spec_key,
    text_dim,
)
from loongforge.diffusion.data.media import BadMedia, decode_frames, read_image, resize_crop

FORMAT = "loongforge-diffusion-latents"
VERSION = 1
VIDEO_EXTENSIONS = (".mp4", ".mkv", ".webm", ".mov")
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp")
SOURCE_FILES = ("captions.jsonl", "metadata.csv")
BAD_REASONS = ("missing", "corrupt", "too_short", "empty_caption", "unsupported")
_TEMPORARY = re.compile(r"\.tmp-\d+$")


@dataclass(frozen=True)
class Entry:
    path: str  # as the source lists it
    caption: str
    line: int  # where the source lists it (1-based; the csv header is line 1)

    @property
    def kind(self) -> str | None:
        ext = os.path.splitext(self.path)[1].lower()
        return "video" if ext in VIDEO_EXTENSIONS else "image" if ext in IMAGE_EXTENSIONS else None


# ---- the source ----------------------------------------------------------------------------------


def source_file(source: Path) -> Path:
    """The list file of a source folder; a UserError if it has none."""
    source = Path(source)
    if not source.is_dir():
        raise UserError(f"source {source} is not a directory (need a folder with captions.jsonl or metadata.csv)")
    for name in SOURCE_FILES:
        if (source / name).is_file():
            return source / name
    raise UserError(f"source {source} has neither captions.jsonl nor metadata.csv")


def read_source(source: Path) -> list[Entry]:
    """The entries of a source folder, in order; a UserError naming the file and line of a
    malformed one."""
    path = source_file(source)
    rows: list[tuple[int, dict]] = []
    if path.suffix == ".jsonl":
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise UserError(f"{path}:{n}: not a JSON object ({e})") from None
            if not isinstance(row, dict):
                raise UserError(f"{path}:{n}: not a JSON object")
            rows.append((n, row))
    else:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            fields = reader.fieldnames or []
            if "caption" not in fields or not ({"video", "image"} & set(fields)):
                raise UserError(f"{path}: needs a `caption` column and a `video` or `image` column (has {fields})")
            for n, row in enumerate(reader, start=2):
                rows.append((n, {k: v for k, v in row.items() if v not in (None, "")}))
    entries = []
    for n, row in rows:
        media = [row[k] for k in ("video", "image") if row.get(k) not in (None, "")]
        if len(media) != 1 or not isinstance(media[0], str):
            raise UserError(f"{path}:{n}: needs exactly one of `video` or `image` (a path)")
        caption = row.get("caption")
        if caption is None:
            caption = ""
        if not isinstance(caption, str):
            raise UserError(f"{path}:{n}: `caption` must be a string, got {caption!r}")
        entries.append(Entry(media[0], caption, n))
    return entries


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---- the output directory ------------------------------------------------------------------------


def _write_json(path: Path, value) -> None:
    write_durable(path, json.dumps(value, indent=2, sort_keys=True) + "\n")


def _shard_name(k: int) -> str:
    return f"{k:05d}"


def _existing_state(out: Path, settings: dict) -> dict | None:
    """The recorded progress of an earlier run of `settings` in `out`, None for a missing or empty
    `out`; a UserError (nothing touched) for anything else."""
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} exists and is not a directory; choose another output directory")
    if not out.exists() or not any(out.iterdir()):
        return None
    try:
        progress = json.loads((out / "progress.json").read_text())
        recorded = progress["settings"]
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"{out} is not empty and is not a preprocessing output; choose another directory (it was left as it is)") from None
    if recorded != settings:
        keys = sorted(k for k in set(recorded) | set(settings) if recorded.get(k) != settings.get(k))
        detail = "; ".join(f"{k}: {recorded.get(k)!r} there, {settings.get(k)!r} now" for k in keys)
        raise UserError(
            f"{out} holds a preprocessing run of another source or other settings ({detail}); choose another directory "
            "or remove it (it was left as it is)"
        )
    return progress


def _begin(out: Path, settings: dict, state: dict | None) -> dict:
    """The progress to continue from, `out` made ready for it: a new output started, or an
    interrupted one's leftovers (temporaries, shards its progress does not count) removed."""
    shards = out / "shards"
    if state is None:
        state = {"settings": settings, "entries_done": 0, "shards": [], "samples": 0, "bad": {}, "complete": False}
        shards.mkdir(parents=True, exist_ok=True)
        _write_json(out / "progress.json", state)
        return state
    shards.mkdir(exist_ok=True)
    kept = {f"{s['name']}{ext}" for s in state["shards"] for ext in (".safetensors", ".json")}
    for p in list(out.iterdir()) + list(shards.iterdir()):
        stale = _TEMPORARY.search(p.name) or (p.parent == shards and p.name not in kept)
        if stale and p.is_file():
            p.unlink()  # an interrupted write, or a shard written after the last recorded progress
    return state


# ---- the samples ---------------------------------------------------------------------------------


class _Bad(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def _load(entry: Entry, source: Path, video_buckets: list[Bucket], image_buckets: list[Bucket], fps):
    """(frames tensor [3, F, H, W] in [-1, 1], bucket) of an entry; _Bad for a bad one."""
    path = Path(entry.path)
    path = path if path.is_absolute() else source / path
    kind = entry.kind
    try:
        if kind == "image":
            frames = read_image(path)
            bucket = choose_bucket(frames.shape[1], frames.shape[2], 1, image_buckets)
            if bucket is None:  # read_source's caller checked that one-frame buckets exist
                raise _Bad("too_short", f"{path}: no one-frame bucket for an image")
        elif kind == "video":
            longest = max(b.frames for b in video_buckets)
            frames = decode_frames(path, longest, fps)
            bucket = choose_bucket(frames.shape[1], frames.shape[2], len(frames), video_buckets)
            if bucket is None:
                shortest = min(b.frames for b in video_buckets)
                at = f" at {fps:g} fps" if fps is not None else ""
                raise _Bad("too_short", f"{path}: {len(frames)} frames{at}, the shortest bucket needs {shortest}")
            frames = frames[: bucket.frames]
        else:
            raise _Bad("unsupported", f"{path}: not a video ({' '.join(VIDEO_EXTENSIONS)}) or image ({' '.join(IMAGE_EXTENSIONS)})")
    except BadMedia as e:
        raise _Bad(e.reason, e.message) from None
    return resize_crop(frames, bucket.height, bucket.width), bucket


def _settings(source: Path, list_file: Path, vae_spec, text_spec, buckets, fps, shard_size, dtype, max_length, family, image_spec) -> dict:
    settings = {
        "format": FORMAT,
        "version": VERSION,
        "source": str(source.resolve()),
        "source_file": list_file.name,
        "source_sha256": _sha256(list_file),
        "vae": spec_key(vae_spec),
        "text_encoder": spec_key(text_spec),
        "buckets": [str(b) for b in buckets],
        "fps": None if fps is None else float(fps),
        "shard_size": int(shard_size),
        "dtype": str(dtype).removeprefix("torch."),
        "max_length": int(max_length),
    }
    if family != "wan":  # Wan outputs stay as they were before families (see the module docstring)
        settings["family"] = family
    if image_spec is not None:  # likewise text-to-video outputs before image-to-video
        settings["image_encoder"] = spec_key(image_spec)
    return settings


def check_family_buckets(buckets: list[Bucket], family: str) -> None:
    """A UserError naming the first bucket `family` cannot train on: Qwen-Image takes images (1
    frame; `parse_buckets` already checked sides divisible by 16)."""
    if family == "qwen_image":
        for b in buckets:
            if b.frames != 1:
                raise UserError(f"bucket {str(b)!r}: Qwen-Image trains on images, every bucket needs 1 frame (e.g. {b.height}x{b.width}x1)")


def preprocess(
    source: Path,
    out: Path,
    *,
    vae_spec: str,
    text_spec: str,
    buckets,
    fps: float | None,
    shard_size: int = 64,
    on_bad_sample: str = "skip",
    dtype=torch.float32,
    progress: bool = True,
    max_length: int = DEFAULT_MAX_LENGTH,
    family: str = "wan",
    image_spec: str | None = None,
) -> dict:
    """Encode `source` into `out` (see the module docstring). Returns a summary: {"out",
    "entries", "samples", "shards", "bad": {reason: count}}. `buckets`: Bucket objects or
    "HxWxF" strings; `family`: "wan" or "qwen_image"; `image_spec`: a CLIP image encoder (Wan2.1
    image-to-video: condition latents and image features too), or None."""
    from tqdm import tqdm

    if on_bad_sample not in ("skip", "error"):
        raise UserError(f"on_bad_sample must be 'skip' or 'error', got {on_bad_sample!r}")
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
        raise UserError(f"shard_size must be a positive int, got {shard_size!r}")
    if fps is not None and not fps > 0:
        raise UserError(f"fps must be positive (or None: every frame), got {fps!r}")
    check_family(family)
    if image_spec is not None and family != "wan":
        raise UserError(f"an image encoder (image-to-video) is Wan2.1's; family {family!r} takes none")
    buckets = parse_buckets(buckets)
    check_family_buckets(buckets, family)
    source, out = Path(source), Path(out)
    list_file = source_file(source)
    entries = read_source(source)
    multi = [b for b in buckets if b.frames > 1]
    video_buckets = multi or list(buckets)
    image_buckets = [b for b in buckets if b.frames == 1]
    if not image_buckets and any(e.kind == "image" for e in entries):
        first = next(e for e in entries if e.kind == "image")
        raise UserError(f"{list_file}:{first.line}: {first.path} is an image, and no bucket has 1 frame (add one, e.g. 480x832x1)")
    settings = _settings(source, list_file, vae_spec, text_spec, buckets, fps, shard_size, dtype, max_length, family, image_spec)
    state = _existing_state(out, settings)
    if state is not None and state["complete"]:
        return _summary(out, state, len(entries))
    vae = load_vae(vae_spec, dtype, family=family)  # before anything is written: a bad spec leaves `out` as it was
    tokenizer, encoder = load_text_encoder(text_spec, dtype, family=family)
    check_text_encoder(encoder, family)
    clip = load_image_encoder(image_spec, dtype) if image_spec is not None else None
    state = _begin(out, settings, state)
    bad: dict[str, int] = dict(state["bad"])
    shards: list[dict] = list(state["shards"])
    samples = int(state["samples"])
    buffer: list[tuple[torch.Tensor, torch.Tensor, dict, dict]] = []

    def flush(entries_done: int) -> None:
        nonlocal samples
        if buffer:
            name = _shard_name(len(shards))
            _write_shard(out / "shards", name, buffer)
            shards.append({"name": name, "samples": len(buffer)})
            samples += len(buffer)
            buffer.clear()
        state.update(entries_done=entries_done, shards=list(shards), samples=samples, bad=dict(sorted(bad.items())))
        _write_json(out / "progress.json", state)

    bar = tqdm(total=len(entries), initial=state["entries_done"], disable=not progress, unit="sample", desc="preprocess")
    try:
        for i in range(state["entries_done"], len(entries)):
            entry = entries[i]
            try:
                if not clean_caption(entry.caption):
                    raise _Bad("empty_caption", f"{entry.path}: empty caption ({list_file.name} line {entry.line})")
                video, bucket = _load(entry, source, video_buckets, image_buckets, fps)
                text = encode_text(tokenizer, encoder, [entry.caption], max_length, family=family)[0]
                if len(text) == 0:
                    raise _Bad("empty_caption", f"{entry.path}: the caption has no tokens ({list_file.name} line {entry.line})")
                latents = encode_video(vae, video.to(dtype))
                extra = {}
                if clip is not None:  # image-to-video: the first frame's condition latents and CLIP features
                    extra["condition"] = encode_video(vae, condition_video(video).to(dtype))
                    extra["image"] = encode_image(*clip, frame_image(video[:, 0]))
            except _Bad as e:
                if on_bad_sample == "error":
                    raise UserError(f"bad sample {entry.path} ({e.reason}): {e}") from None
                bad[e.reason] = bad.get(e.reason, 0) + 1
                bar.set_postfix(bad=sum(bad.values()))
            else:
                info = {
                    "caption": entry.caption,
                    "source": entry.path,
                    "entry": i,
                    "bucket": str(bucket),
                    "latent_shape": list(latents.shape),
                    "text_length": int(text.shape[0]),
                }
                buffer.append((latents, text, info, extra))
                if len(buffer) == shard_size:
                    flush(i + 1)
            bar.update(1)
        flush(len(entries))
    finally:
        bar.close()

    meta = {
        "format": FORMAT,
        "version": VERSION,
        "vae": settings["vae"],
        "text_encoder": settings["text_encoder"],
        "latent_channels": int(vae.config.z_dim),
        "text_dim": text_dim(encoder),
        "buckets": settings["buckets"],
        "source": str(source),
        "fps": settings["fps"],
        "dtype": settings["dtype"],
        "max_length": settings["max_length"],
        "samples": samples,
        "shards": shards,
        "bad": dict(sorted(bad.items())),
    }
    if "family" in settings:
        meta["family"] = settings["family"]
    if clip is not None:
        meta["image_encoder"] = settings["image_encoder"]
        meta["image_dim"] = image_dim(clip[1])
    _write_json(out / "meta.json", meta)
    state["complete"] = True
    _write_json(out / "progress.json", state)
    return _summary(out, state, len(entries))


def _summary(out: Path, state: dict, entries: int) -> dict:
    return {"out": str(out), "entries": entries, "samples": state["samples"], "shards": len(state["shards"]), "bad": dict(state["bad"])}


def _write_shard(directory: Path, name: str, buffer) -> None:
    from safetensors.torch import save

    tensors = {}
    for j, (latents, text, _, extra) in enumerate(buffer):
        tensors[f"latents.{j}"] = latents.detach().to("cpu").contiguous()
        tensors[f"text.{j}"] = text.detach().to("cpu").contiguous()
        for key, value in extra.items():  # image-to-video: condition.{j}, image.{j}
            tensors[f"{key}.{j}"] = value.detach().to("cpu").contiguous()
    write_durable(directory / f"{name}.safetensors", save(tensors, metadata={"format": FORMAT}))
    _write_json(directory / f"{name}.json", {"samples": [info for _, _, info, _ in buffer]})


# ---- reading ---------------------------------------------------------------------------------------


def read_meta(out: Path) -> dict:
    """`out/meta.json` of a complete preprocessing output; a UserError otherwise."""
    out = Path(out)
    path = out / "meta.json"
    if not path.is_file():
        hint = " (its preprocessing did not finish: run it again to resume)" if (out / "progress.json").is_file() else ""
        raise UserError(f"{out}: no meta.json; not a preprocessed latent directory{hint}")
    try:
        meta = json.loads(path.read_text())
    except ValueError as e:
        raise UserError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise UserError(f"{path}: format {found!r}, expected {FORMAT!r}")
    if meta.get("version") != VERSION:
        raise UserError(f"{path}: version {meta.get('version')!r} of {FORMAT}, this LoongForge reads version {VERSION}")
    return meta


class LatentDataset:
    """The samples of a preprocessing output, read lazily from its shards (the last shard opened
    stays open, per process)."""

    def __init__(self, out: Path):
        self.root = Path(out)
        self.meta = read_meta(self.root)
        self.family: str = self.meta.get("family", "wan")  # Wan outputs record none
        self._index: list[tuple[str, int]] = []
        self._info: list[dict] = []
        for shard in self.meta["shards"]:
            path = self.root / "shards" / f"{shard['name']}.json"
            try:
                samples = json.loads(path.read_text())["samples"]
            except (OSError, ValueError, KeyError) as e:
                raise UserError(f"{path}: cannot read the shard's metadata ({e})") from None
            if len(samples) != shard["samples"]:
                raise UserError(f"{path}: {len(samples)} samples, meta.json says {shard['samples']}")
            self._index += [(shard["name"], j) for j in range(len(samples))]
            self._info += samples
        self._open: tuple[int, str, object] | None = None  # (pid, shard name, safe_open handle)

    def __len__(self) -> int:
        return len(self._index)

    def shapes(self) -> list[tuple[int, ...]]:
        """Each sample's latent shape (C, F, H, W), from the shard metadata (no tensor is read)."""
        return [tuple(info["latent_shape"]) for info in self._info]

    def info(self, i: int) -> dict:
        """Sample i's metadata: caption, source, entry, bucket, latent_shape, text_length."""
        return dict(self._info[i])

    def _shard(self, name: str):
        from safetensors import safe_open

        if self._open is None or self._open[0] != os.getpid() or self._open[1] != name:
            path = self.root / "shards" / f"{name}.safetensors"
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as e:  # safetensors raises its own error types for torn files
                raise UserError(f"{path}: cannot open the shard ({e})") from None
            self._open = (os.getpid(), name, handle)
        return self._open[2]

    def get(self, i: int) -> dict:
        """{"latents": float32 [C, F, H, W], "text": float32 [L, D], "caption": str} of sample i;
        an image-to-video output's also "condition" float32 [C, F, H, W] and "image" float32
        [tokens, image_dim]."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} of {len(self)}")
        name, j = self._index[i]
        shard = self._shard(name)
        item = {
            "latents": shard.get_tensor(f"latents.{j}").float(),
            "text": shard.get_tensor(f"text.{j}").float(),
            "caption": self._info[i]["caption"],
        }
        if "image_dim" in self.meta:
            item["condition"] = shard.get_tensor(f"condition.{j}").float()
            item["image"] = shard.get_tensor(f"image.{j}").float()
        return item

    __getitem__ = get
