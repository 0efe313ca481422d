"""Vision-language SFT data (Qwen2-VL / Qwen2.5-VL style).

- `formats`: `read_records(paths, fmt, media_root)` reads LLaVA-style JSON, sharegpt / openai
  messages (JSON, JSONL) and parquet files with image bytes into `VisionRecord`s (messages whose
  content is a list of text / image / video parts, and the image and video sources), yielding
  the `BadSample` of each row it cannot use in its place; `to_record` does one row.
- `encode`: `VisionSampleEncoder(tokenizer, VisionProcessorConfig(...), max_length).encode(record)`
  -> input_ids with the vision pads expanded, assistant-only labels, pixel values and grids as
  transformers' Qwen2-VL processor gives them, M-RoPE position rows; with `video_timestamps`
  each video's frame groups apart after their `<t seconds>` text (Qwen3-VL).
- `llava`: `LlavaSampleEncoder(tokenizer, LlavaOnevisionConfig(...), max_length).encode(record)` ->
  the same for LLaVA-OneVision: `<image>` expanded to each image's feature count, anyres tiles (one
  tile per image in a sample of several) as transformers' LlavaOnevisionProcessor gives them,
  1-D positions; `<video>` expanded for a fixed count of uniformly sampled frames.
- `dataset`: `encode_all(records, encoder, on_bad_sample)` -> (samples, Counter of bad reasons).
- `demo`: `write_demo_dataset(out_dir, samples, seed)` writes a small LLaVA-style set of shapes.

`TINY_TOKENIZER` is the shipped demo tokenizer: core's tiny BPE plus Qwen2-VL's special tokens
and chat template (made by tools/make_vlm_tiny_tokenizer.py); `TINY_LLAVA_TOKENIZER` the same BPE with
`<|im_start|>`, `<|im_end|>`, `<image>`, `<video>` and LLaVA-OneVision's chat template.
"""

from pathlib import Path

from loongforge.vlm.data.dataset import encode_all
from loongforge.vlm.data.demo import write_demo_dataset
from loongforge.vlm.data.encode import IMAGE_TOKEN, VIDEO_TOKEN, VisionProcessorConfig, VisionSampleEncoder
from loongforge.vlm.data.formats import FORMATS, VisionRecord, read_records, to_record
from loongforge.vlm.data.llava import LlavaSampleEncoder

TINY_TOKENIZER = Path(__file__).resolve().parent.parent / "assets" / "tiny_tokenizer"
TINY_LLAVA_TOKENIZER = TINY_TOKENIZER.parent / "tiny_llava_tokenizer"

__all__ = [
    "FORMATS",
    "IMAGE_TOKEN",
    "TINY_LLAVA_TOKENIZER",
    "TINY_TOKENIZER",
    "VIDEO_TOKEN",
    "LlavaSampleEncoder",
    "VisionProcessorConfig",
    "VisionRecord",
    "VisionSampleEncoder",
    "encode_all",
    "read_records",
    "to_record",
    "write_demo_dataset",
]
