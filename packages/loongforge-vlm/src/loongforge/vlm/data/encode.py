"""A `VisionRecord` -> one Qwen2-VL / Qwen2.5-VL / Qwen3-VL training sample.

    enc = VisionSampleEncoder(tokenizer, VisionProcessorConfig(max_pixels=128 * 28 * 28), max_length=2048)
    sample = enc.encode(record)

The conversation goes through the chat template with assistant-only labels (core's
`SFTTokenizer`; each image part renders as `<|vision_start|><|image_pad|><|vision_end|>`); the
images are processed by transformers' PIL `Qwen2VLImageProcessor` (resized to multiples of
patch_size * merge_size within [min_pixels, max_pixels], rescaled, normalized, cut into patches
of temporal_patch_size copies); each `<|image_pad|>` then becomes grid_t * grid_h * grid_w /
merge_size^2 copies of itself, which is what `Qwen2_5_VLProcessor` does to the text. Videos are
decoded with PyAV at `video_fps` (core's `decode_frames`: the frame shown at each 1 / fps step),
at most `video_max_frames` frames, each frame resized within [video_min_pixels,
video_max_pixels] and normalized as an image, and patched as Qwen2-VL's video processor does:
frames in groups of temporal_patch_size (the last repeated to fill the group), each group's
patches laid out as an image's; `second_per_grid_ts` = temporal_patch_size / video_fps. M-RoPE
positions come from core's `mrope_positions` (tokens_per_second: 2 for Qwen2.5-VL).

With `video_timestamps` (Qwen3-VL) a video's frames sit apart in the text instead, as Qwen3-VL's
processor writes them (transformers 4.57's `Qwen3VLProcessor.__call__`, its authors' format): the
rendered `<|vision_start|><|video_pad|><|vision_end|>` (or a bare `<|video_pad|>`) becomes, per
frame group g (temporal_patch_size frames), the text `<{t_g:.1f} seconds>` then `<|vision_start|>`,
the group's h * w / merge_size^2 pads and `<|vision_end|>`. t_g is `_calculate_timestamps`': frame k
of the decoded video is at k / video_fps seconds (`decode_frames` samples the frame shown at each
1 / fps step from the first), the indices padded with the last to whole groups as the frames are,
and t_g the mean of the group's first and last frame times. The timestamp text is tokenized as the
processor's tokenization of the whole prompt does: each piece after the first lies between
`<|vision_end|>` and `<|vision_start|>`, added tokens the tokenizer splits the text at before its
pre-tokenizer runs, so alone it tokenizes the same; the first follows the text before the video
(e.g. "Video 1: "), with which a Qwen BPE merges across the boundary (" <" is one token), so that
text run is tokenized again with it (its trained labels kept where its tokens stay the same). The
inserted tokens are never trained on (labels -100) and are text tokens; each frame group is its
own vision item at time position 0 (`Qwen3VLModel.get_rope_index`); `video_grid_thw` stays one
[t, h, w] row per video, and `second_per_grid_ts` is None (Qwen3-VL has no time positions).

`encode` returns (T tokens):
    input_ids            LongTensor [T]
    labels               LongTensor [T], -100 except on assistant tokens (same positions as input_ids)
    position_ids         LongTensor [3, T] (time, height, width rows)
    mm_token_type_ids    LongTensor [T]: 0 text, 1 image pad, 2 video pad (HF's token types)
    pixel_values         FloatTensor [image patches, 3 * temporal_patch_size * patch_size^2], or None
    image_grid_thw       LongTensor [images, 3], or None
    pixel_values_videos  FloatTensor [video patches, 3 * temporal_patch_size * patch_size^2], or None
    video_grid_thw       LongTensor [videos, 3], or None
    second_per_grid_ts   FloatTensor [videos], or None (always None with video_timestamps)

Bad samples raise BadSample: "over_long" (more than max_length tokens once the pads are
expanded), "missing_media" / "corrupt_media" (a file gone or not decodable), "bad_media_size" (an
image the processor refuses, e.g. an aspect ratio above 200), "placeholder_mismatch" (the template
rendered another number of pads than the record has media), and core's "template_error".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np
import torch
from loongforge.core.data.media import BadMedia, decode_frames, open_image
from loongforge.core.data.text import IGNORE, BadSample, SFTTokenizer
from loongforge.core.errors import UserError
from loongforge.core.foundation.mrope import IMAGE, TEXT, VIDEO, mrope_positions
from loongforge.vlm.data.formats import VisionRecord

IMAGE_TOKEN, VIDEO_TOKEN = "<|image_pad|>", "<|video_pad|>"
VISION_START_TOKEN, VISION_END_TOKEN = "<|vision_start|>", "<|vision_end|>"
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def special_token_id(tokenizer, token: str) -> int:
    """The id of a tokenizer's special `token` (it must round-trip: an unknown token maps to the
    unk id, or to None); a UserError naming it otherwise."""
    i = tokenizer.convert_tokens_to_ids(token)
    if i is None or tokenizer.convert_ids_to_tokens(i) != token:
        raise UserError(f"the tokenizer has no {token} token (a Qwen2-VL-style tokenizer has it as a special token; set data.tokenizer)")
    return int(i)


@dataclass
class VisionProcessorConfig:
    """Qwen2-VL's image processing (its preprocessor_config.json's fields; the defaults are
    transformers' `Qwen2VLImageProcessor` defaults), its video sampling and sizes (the defaults are
    `Qwen2VLVideoProcessor`'s sizes and qwen-vl-utils' 2 fps), the model's tokens_per_second
    (Qwen2.5-VL's vision_config, used for the time row of video positions), and `video_timestamps`:
    a video's frame groups apart in the text, each after its timestamp (Qwen3-VL; see the module
    docstring), else one run of pads with time positions (Qwen2-VL / Qwen2.5-VL)."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple = CLIP_MEAN
    image_std: tuple = CLIP_STD
    video_fps: float = 2.0
    video_min_pixels: int = 128 * 28 * 28
    video_max_pixels: int = 768 * 28 * 28
    video_max_frames: int = 768
    tokens_per_second: float = 2.0
    video_timestamps: bool = False  # Qwen3-VL's video prompts: `<t seconds>` + each frame group's pads

    def __post_init__(self):
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels", "video_max_frames"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UserError(f"vision processor: {name} must be a positive int, got {v!r}")
        if self.min_pixels > self.max_pixels or self.video_min_pixels > self.video_max_pixels:
            raise UserError("vision processor: min_pixels must not exceed max_pixels (images and videos)")
        if not self.video_fps > 0:
            raise UserError(f"vision processor: video_fps must be positive, got {self.video_fps!r}")
        if len(self.image_mean) != 3 or len(self.image_std) != 3:
            raise UserError("vision processor: image_mean and image_std need 3 values (RGB)")
        self.image_mean, self.image_std = tuple(float(x) for x in self.image_mean), tuple(float(x) for x in self.image_std)

    @classmethod
    def from_hf(cls, path, **overrides) -> VisionProcessorConfig:
        """The settings of an HF Qwen2-VL / Qwen2.5-VL / Qwen3-VL directory: preprocessor_config.json,
        video_preprocessor_config.json (if there), config.json's vision_config.tokens_per_second and
        its model_type (Qwen3-VL: video_timestamps); `overrides` win."""
        path = Path(path)

        def read(name: str) -> dict:
            f = path / name
            if not f.is_file():
                return {}
            try:
                return json.loads(f.read_text())
            except json.JSONDecodeError as e:
                raise UserError(f"{f}: not JSON: {e}") from None

        image, video, model = read("preprocessor_config.json"), read("video_preprocessor_config.json"), read("config.json")
        if not image:
            raise UserError(f"{path}: no preprocessor_config.json (an HF Qwen2-VL / Qwen2.5-VL directory has one)")
        kw: dict = {k: image[k] for k in ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std") if k in image}
        size = image.get("size") or {}
        kw["min_pixels"] = image.get("min_pixels", size.get("shortest_edge", cls.min_pixels))
        kw["max_pixels"] = image.get("max_pixels", size.get("longest_edge", cls.max_pixels))
        vsize = video.get("size") or {}
        kw["video_min_pixels"] = video.get("min_pixels", vsize.get("shortest_edge", cls.video_min_pixels))
        kw["video_max_pixels"] = video.get("max_pixels", vsize.get("longest_edge", cls.video_max_pixels))
        if video.get("fps"):
            kw["video_fps"] = video["fps"]
        if video.get("max_frames"):
            kw["video_max_frames"] = video["max_frames"]
        tps = (model.get("vision_config") or {}).get("tokens_per_second")
        if tps is not None:
            kw["tokens_per_second"] = tps
        from loongforge.vlm.model import ARCHS  # the architectures' table imports this module

        arch = ARCHS.get(model.get("model_type"))
        if arch is not None:
            kw["video_timestamps"] = arch.frames_apart
        return cls(**{**kw, **overrides})


def _pil_processor_class():
    """transformers' PIL (slow) Qwen2-VL image processor: `Qwen2VLImageProcessorPil` in
    transformers 5, `Qwen2VLImageProcessor` in 4 (where the fast one is `...Fast`)."""
    import transformers

    cls = getattr(transformers, "Qwen2VLImageProcessorPil", None)
    return cls if cls is not None else transformers.Qwen2VLImageProcessor


class ChatVisionEncoder:
    """The chat-template side every family's encoder shares: a record rendered with the
    tokenizer's template (core's SFTTokenizer `self.sft`: assistant-only labels), then the
    family's `_expanded(record, ids, labels)` puts its vision items in."""

    def encode(self, record: VisionRecord) -> dict:
        """The sample of `record` (module docstring); raises BadSample."""
        text = self.sft(record.messages, tools=record.tools)
        return self._expanded(record, text["input_ids"], text["labels"])

    def prompt(self, record: VisionRecord) -> dict:
        """Generation inputs: `record`'s messages rendered with the template's generation prompt
        (the assistant's turn opened), as `encode` returns them (labels all -100)."""
        ids = self.tokenizer.apply_chat_template(
            record.messages, chat_template=self.sft.template, add_generation_prompt=True, tokenize=True
        )
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return self._expanded(record, ids, [IGNORE] * len(ids))

    def __call__(self, record: VisionRecord) -> dict:
        return self.encode(record)


class VisionSampleEncoder(ChatVisionEncoder):
    """VisionRecord -> sample dict (see the module docstring). `processor`: a
    VisionProcessorConfig or a dict of its fields; keyword options named as its fields
    (`max_pixels=...`, `tokens_per_second=...`) override them. `template` and the other keyword
    options are core's SFTTokenizer's (train_on_prompt, last_turn_only, append_eos,
    template_kwargs; default: the tokenizer's own chat template, loss on assistant turns only).
    `vision_start_token` / `vision_end_token` are needed with video_timestamps only."""

    def __init__(
        self,
        tokenizer,
        processor: VisionProcessorConfig | dict | None = None,
        max_length: int = 4096,
        template: str | None = None,
        image_token: str = IMAGE_TOKEN,
        video_token: str = VIDEO_TOKEN,
        vision_start_token: str = VISION_START_TOKEN,
        vision_end_token: str = VISION_END_TOKEN,
        **options,
    ):
        names = {f.name for f in fields(VisionProcessorConfig)}
        if isinstance(processor, dict):
            unknown = set(processor) - names
            if unknown:
                raise UserError(f"vision processor: unknown keys {sorted(unknown)}")
            processor = VisionProcessorConfig(**processor)
        processor = processor or VisionProcessorConfig()
        overrides = {k: options.pop(k) for k in list(options) if k in names}
        self.config = replace(processor, **overrides) if overrides else processor
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.sft = SFTTokenizer(tokenizer, template, max_length=max_length, **options)
        self.image_token_id = special_token_id(self.tokenizer, image_token)
        self.video_token_id = special_token_id(self.tokenizer, video_token)
        c = self.config
        if c.video_timestamps:
            self.vision_start_id, self.vision_end_id = (
                special_token_id(self.tokenizer, vision_start_token),
                special_token_id(self.tokenizer, vision_end_token),
            )
            # the tokens the tokenizer cuts the text at before pre-tokenizing (its added tokens)
            added = getattr(tokenizer, "added_tokens_decoder", None) or {}
            self._cut_ids = {int(i) for i in added} | {self.image_token_id, self.video_token_id, self.vision_start_id, self.vision_end_id}
            self._piece_cache: dict[str, list[int]] = {}
        common = dict(
            patch_size=c.patch_size,
            temporal_patch_size=c.temporal_patch_size,
            merge_size=c.merge_size,
            image_mean=list(c.image_mean),
            image_std=list(c.image_std),
        )
        cls = _pil_processor_class()
        self.image_processor = cls(min_pixels=c.min_pixels, max_pixels=c.max_pixels, **common)
        self.frame_processor = cls(min_pixels=c.video_min_pixels, max_pixels=c.video_max_pixels, **common)

    def _expanded(self, record: VisionRecord, ids: list, labels: list) -> dict:
        """Each vision pad expanded to its item's merged patches, the pixels, the positions."""
        for token_id, media, kind in ((self.image_token_id, record.images, "image"), (self.video_token_id, record.videos, "video")):
            pads = sum(1 for t in ids if t == token_id)
            if pads != len(media):
                raise BadSample("placeholder_mismatch", f"the chat template rendered {pads} {kind} pads for {len(media)} {kind}s")
        images = self._images(record.images)
        videos, seconds = self._videos(record.videos)
        merge = self.config.merge_size**2
        counts = {
            self.image_token_id: iter([] if images is None else (images["image_grid_thw"].prod(-1) // merge).tolist()),
            self.video_token_id: iter([] if videos is None else (videos["video_grid_thw"].prod(-1) // merge).tolist()),
        }
        video_grids = [] if videos is None else videos["video_grid_thw"].tolist()
        out_ids, out_labels, types = [], [], []
        kind_of = {self.image_token_id: IMAGE, self.video_token_id: VIDEO}
        stamped = iter(zip(video_grids, seconds or []))
        skip = False
        for i, (t, label) in enumerate(zip(ids, labels)):
            if skip:  # the <|vision_end|> of a video put apart
                skip = False
            elif t == self.video_token_id and self.config.video_timestamps:
                # HF replaces the whole <|vision_start|><|video_pad|><|vision_end|>, else the pad alone
                if out_ids and out_ids[-1] == self.vision_start_id and i + 1 < len(ids) and ids[i + 1] == self.vision_end_id:
                    del out_ids[-1], out_labels[-1], types[-1]
                    skip = True
                self._put_frames(out_ids, out_labels, types, *next(stamped))
            elif t in kind_of:
                n = next(counts[t])
                out_ids += [t] * n
                out_labels += [IGNORE] * n
                types += [kind_of[t]] * n
            else:
                out_ids.append(t)
                out_labels.append(label)
                types.append(TEXT)
        if len(out_ids) > self.max_length:
            raise BadSample("over_long", f"{len(out_ids)} > {self.max_length} tokens with the vision pads expanded")
        if self.config.video_timestamps:  # each frame group its own item (t = 1: no time step)
            video_grids = [[1, h, w] for t, h, w in video_grids for _ in range(t)]
            steps = [1.0] * len(video_grids)
        else:
            steps = [] if videos is None else videos["second_per_grid_ts"].tolist()
        positions = mrope_positions(
            types,
            [] if images is None else images["image_grid_thw"].tolist(),
            video_grids,
            steps,
            spatial_merge=self.config.merge_size,
            tokens_per_second=self.config.tokens_per_second,
        )
        sample = {
            "input_ids": torch.tensor(out_ids, dtype=torch.long),
            "labels": torch.tensor(out_labels, dtype=torch.long),
            "position_ids": positions.to(torch.long),
            "mm_token_type_ids": torch.tensor(types, dtype=torch.long),
            "pixel_values": None,
            "image_grid_thw": None,
            "pixel_values_videos": None,
            "video_grid_thw": None,
            "second_per_grid_ts": None,
        }
        sample.update(images or {})
        sample.update(videos or {})
        return sample

    def _put_frames(self, out_ids: list, out_labels: list, types: list, grid: list, seconds: list) -> None:
        """Append a video's frame groups apart: per group its timestamp text, <|vision_start|>, its
        pads and <|vision_end|> (none trained on)."""
        _, h, w = grid
        pads = h * w // self.config.merge_size**2
        for g, t in enumerate(seconds):
            text = f"<{t:.1f} seconds>"
            if g == 0:
                self._put_after_text(out_ids, out_labels, types, text)
            else:  # between <|vision_end|> and <|vision_start|>: tokenized alone as in the whole prompt
                piece = self._piece(text)
                out_ids += piece
                out_labels += [IGNORE] * len(piece)
                types += [TEXT] * len(piece)
            out_ids += [self.vision_start_id] + [self.video_token_id] * pads + [self.vision_end_id]
            out_labels += [IGNORE] * (pads + 2)
            types += [TEXT] + [VIDEO] * pads + [TEXT]

    def _put_after_text(self, out_ids: list, out_labels: list, types: list, text: str) -> None:
        """Append `text` tokenized with the run of text tokens it follows (back to the last added
        token: the span the tokenizer pre-tokenizes with it), as tokenizing the whole prompt does;
        the run's tokens that stay keep their labels, the rest and `text`'s are not trained on."""
        start = len(out_ids)
        while start > 0 and out_ids[start - 1] not in self._cut_ids:
            start -= 1
        if start == len(out_ids):
            new = self._piece(text)
        else:
            before = self.tokenizer.decode(out_ids[start:], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            new = list(self.tokenizer(before + text, add_special_tokens=False)["input_ids"])
        kept = 0
        while kept < min(len(new), len(out_ids) - start) and new[kept] == out_ids[start + kept]:
            kept += 1
        out_labels[start:] = out_labels[start : start + kept] + [IGNORE] * (len(new) - kept)
        out_ids[start:] = new
        types[start:] = [TEXT] * len(new)

    def _piece(self, text: str) -> list[int]:
        ids = self._piece_cache.get(text)
        if ids is None:
            ids = self._piece_cache[text] = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return ids

    # ---- media ---------------------------------------------------------------------------------

    def _images(self, sources) -> dict | None:
        if not sources:
            return None
        pil = [open_source_image(s) for s in sources]
        try:
            out = self.image_processor(images=pil, return_tensors="pt")
        except ValueError as e:  # smart_resize refuses aspect ratios above 200
            raise BadSample("bad_media_size", str(e).splitlines()[0]) from None
        return {"pixel_values": out["pixel_values"].to(torch.float32), "image_grid_thw": out["image_grid_thw"].to(torch.long)}

    def _videos(self, sources) -> tuple[dict | None, list | None]:
        """(the videos' sample entries, with video_timestamps each video's frame group times)."""
        if not sources:
            return None, None
        patches, grids, frames = [], [], []
        for s in sources:
            p, grid, n = self._video(s)
            patches.append(p)
            grids.append(grid)
            frames.append(n)
        c, tp = self.config, self.config.temporal_patch_size
        out = {"pixel_values_videos": torch.cat(patches), "video_grid_thw": torch.tensor(grids, dtype=torch.long)}
        if c.video_timestamps:  # Qwen3-VL: no time positions, so no seconds per grid
            return {**out, "second_per_grid_ts": None}, [group_seconds(n, c.video_fps, tp) for n in frames]
        return {**out, "second_per_grid_ts": torch.full((len(sources),), tp / c.video_fps, dtype=torch.float32)}, None

    def _video(self, source) -> tuple[torch.Tensor, list[int], int]:
        """(patches [t * h * w, C * tp * p * p], [t, h, w], frames decoded) of one video, as Qwen2-VL's
        video processor lays them out: group g holds frames g*tp ... g*tp + tp - 1 of every patch (the
        last frame repeated to fill the last group)."""
        from PIL import Image

        c = self.config
        try:
            frames = decode_frames(source, c.video_max_frames, c.video_fps)
        except BadMedia as e:
            raise BadSample(f"{e.reason}_media", e.message) from None
        decoded = len(frames)
        frames = list(frames) + [frames[-1]] * (-len(frames) % c.temporal_patch_size)
        try:
            out = self.frame_processor(images=[Image.fromarray(f) for f in frames], return_tensors="np")
        except ValueError as e:
            raise BadSample("bad_media_size", str(e).splitlines()[0]) from None
        grid = out["image_grid_thw"]
        _, h, w = (int(v) for v in grid[0])
        p, tp = c.patch_size, c.temporal_patch_size
        # every frame's patches hold tp equal copies of it (an image's layout): keep one, then group frames
        one = np.asarray(out["pixel_values"]).reshape(len(frames), h * w, 3, tp, p, p)[:, :, :, 0]  # [F, hw, C, p, p]
        t = len(frames) // tp
        grouped = one.reshape(t, tp, h * w, 3, p, p).transpose(0, 2, 3, 1, 4, 5)  # [t, hw, C, tp, p, p]
        patches = torch.from_numpy(np.ascontiguousarray(grouped).reshape(t * h * w, 3 * tp * p * p)).to(torch.float32)
        return patches, [t, h, w], decoded


def group_seconds(frames: int, fps: float, temporal_patch_size: int) -> list[float]:
    """The time of each frame group of a video of `frames` frames sampled at `fps` from its start
    (frame k at k / fps), as transformers' `Qwen3VLProcessor._calculate_timestamps` computes it for
    frame indices 0 ... frames - 1 at that fps: the indices padded with the last to whole groups,
    then per group the mean of its first and last frame's time."""
    indices = list(range(frames)) + [frames - 1] * (-frames % temporal_patch_size)
    times = [i / fps for i in indices]
    return [(times[g] + times[g + temporal_patch_size - 1]) / 2 for g in range(0, len(times), temporal_patch_size)]


def open_source_image(source):
    """A record's image source (a path, bytes or a PIL image) as an RGB PIL image; BadSample
    (missing_media, corrupt_media, ...) where it cannot be opened."""
    if hasattr(source, "convert"):  # a PIL image given in a record built in code
        return source.convert("RGB")
    try:
        return open_image(source)
    except BadMedia as e:
        raise BadSample(f"{e.reason}_media", e.message) from None


__all__ = [
    "IMAGE_TOKEN",
    "VIDEO_TOKEN",
    "ChatVisionEncoder",
    "VisionProcessorConfig",
    "VisionSampleEncoder",
    "group_seconds",
    "open_source_image",
]
