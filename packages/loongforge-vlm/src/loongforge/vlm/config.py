"""The VLM run config: core's shared sections, the composed model (vision tower + language
model), what of it trains, and the conversation data with images and videos."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from loongforge.core.config import CheckpointConfig, ParallelConfig, TrainConfig
from loongforge.core.data import SampleCost
from loongforge.core.foundation.lora import LoRAConfig
from loongforge.vlm.data.llava import LLAVA_OV_VIDEO_FRAMES
from loongforge.vlm.model import VLMConfig

CONFIG_DIR = Path(__file__).parent / "configs"


@dataclass
class FreezeConfig:
    """Parts kept frozen (out of the optimizer; still in the checkpoint)."""

    vision: bool = False  # the ViT blocks and patch embedding
    projector: bool = False  # the patch merger (Qwen2.5-VL's projector into the language model)
    language: bool = False  # the language model (embedding, decoder, output layer)


@dataclass
class LRMultConfig:
    """Each part's learning rate as a multiple of the schedule's (`train.lr` ...)."""

    vision: float = 1.0
    projector: float = 1.0
    language: float = 1.0


@dataclass
class ImageConfig:
    """Qwen2-VL image processing: images resized to multiples of patch_size * merge_size with
    their pixel count kept within [min_pixels, max_pixels]; videos sampled at video_fps.
    LLaVA-OneVision reads `video_frames` only (its tiles come from the model's config)."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    video_fps: float = 2.0  # videos decoded at this frame rate
    video_min_pixels: int = 128 * 28 * 28  # per frame
    video_max_pixels: int = 768 * 28 * 28
    video_max_frames: int = 768
    # LLaVA-OneVision only: frames sampled uniformly from each video, a fixed count (every video
    # [frames, 3, S, S]; frames * ceil(side / 2)^2 + 1 tokens: 1569 at 384 px). 8 as transformers'
    # examples; LLaVA-OneVision's own video training sampled up to 32
    video_frames: int = LLAVA_OV_VIDEO_FRAMES


@dataclass
class RecomputeConfig:
    """Activation recompute per part (each block's activations recomputed in backward); None:
    `train.recompute`."""

    vision: Optional[bool] = None  # the vision tower's blocks
    language: Optional[bool] = None  # the language model's layers


@dataclass
class VLMDataConfig:
    # files of conversations: LLaVA-style JSON, sharegpt / openai messages (JSON / JSONL) or
    # parquet with image bytes; "demo": the shipped generator's shapes (written into the run dir)
    paths: List[str] = field(default_factory=lambda: ["demo"])
    prepacked: Optional[str] = None  # a `loongforge-vlm preprocess` output directory: its packs instead of `paths`
    format: str = "auto"  # auto | llava | sharegpt | openai (parquet files by their suffix)
    media_root: Optional[str] = None  # relative image / video paths are under this (default: each file's folder)
    tokenizer: str = "tiny"  # an HF tokenizer directory with the family's vision tokens, or "tiny" (the shipped demo's)
    seq_length: int = 1024  # tokens per pack (samples longer are bad samples: over_long)
    on_bad_sample: str = "skip"  # skip (counted by reason) | error
    image: ImageConfig = field(default_factory=ImageConfig)
    demo_samples: int = 96  # data.paths=[demo]: how many generated samples
    # which packs each data-parallel rank trains on: cost (each step's packs assigned by
    # `cost`, so ranks finish together) | contiguous (each rank a contiguous share)
    balance: str = "cost"
    # a pack's cost: the sum of its samples' (attention-quadratic + linear terms for the language
    # model's tokens and each image's / video's patches); the default is FLOPs of a Qwen2.5-VL-7B
    # shape (fit your own from step times with loongforge.core.data.SampleCost.fit)
    cost: SampleCost = field(
        default_factory=lambda: SampleCost(llm_quadratic=602112.0, llm_linear=4.24e10, vit_quadratic=61440.0, vit_linear=3.88e9)
    )
    seed: int = 0  # the pack order


@dataclass
class VLMRunConfig:
    recipe: str = "vlm.sft"
    model: VLMConfig = field(default_factory=VLMConfig)
    freeze: FreezeConfig = field(default_factory=FreezeConfig)
    lr_mult: LRMultConfig = field(default_factory=LRMultConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # adapters on the language model's linears
    data: VLMDataConfig = field(default_factory=VLMDataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(micro_batch_size=1))
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)  # checkpoint.load: an HF Qwen2.5-VL directory or a run
    ops: dict = field(default_factory=dict)  # op name -> implementation
