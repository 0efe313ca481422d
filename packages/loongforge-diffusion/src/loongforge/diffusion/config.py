"""The diffusion run config: core's shared sections, the transformer's shape, the flow-matching
objective, the latent data and the frozen encoders."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from loongforge.core.config import CheckpointConfig, ParallelConfig, TrainConfig
from loongforge.diffusion.flow_matching import FlowMatchingConfig
from loongforge.diffusion.models.qwen_image import QwenImageConfig
from loongforge.diffusion.models.wan import WanConfig

CONFIG_DIR = Path(__file__).parent / "configs"


@dataclass
class DemoDataConfig:
    """The generated demo set (data.root=demo): tiny videos of moving shapes with captions."""

    count: int = 24
    frames: int = 9
    height: int = 64
    width: int = 64


@dataclass
class LatentDataConfig:
    root: str = "demo"  # a directory `loongforge-diffusion preprocess` wrote, or "demo" (generated and preprocessed into run_dir/data)
    text_len: int = 512  # text states zero-padded to this many tokens, as Wan's pipeline pads them
    seed: int = 0  # the sample order
    demo: DemoDataConfig = field(default_factory=DemoDataConfig)


@dataclass
class FrozenConfig:
    """The frozen encoders: HF / diffusers directories (a Wan pipeline directory has both), or
    "tiny": small random ones of a fixed seed (demo and tests; no download)."""

    vae: str = "tiny"  # AutoencoderKLWan
    text_encoder: str = "tiny"  # UMT5EncoderModel + its tokenizer
    # Wan2.1 image-to-video (model.image_dim set): the CLIPVisionModel + CLIPImageProcessor (a Wan
    # I2V pipeline directory has both), or "tiny"; None: text-to-video, no image encoder
    image_encoder: Optional[str] = None
    fps: float = 16.0  # preprocessing samples videos at this frame rate
    buckets: List[str] = field(default_factory=lambda: ["64x64x9"])  # HxWxF preprocessing buckets (F = 4k + 1)


@dataclass
class WanRunConfig:
    recipe: str = "diffusion.wan"
    model: WanConfig = field(default_factory=WanConfig)
    # Wan2.2 A14B: two transformers of the model's shape trained together, the high-noise one for
    # times >= boundary_ratio * flow.num_train_timesteps, the low-noise one below (0.875 for
    # A14B text-to-video); None: one transformer
    boundary_ratio: Optional[float] = None
    flow: FlowMatchingConfig = field(default_factory=FlowMatchingConfig)
    data: LatentDataConfig = field(default_factory=LatentDataConfig)
    frozen: FrozenConfig = field(default_factory=FrozenConfig)
    parallel: ParallelConfig = field(default_factory=lambda: ParallelConfig(stack="torch", data_parallel_mode="ddp"))
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)  # checkpoint.load: a diffusers WanTransformer3DModel directory
    ops: dict = field(default_factory=dict)  # op name -> implementation


@dataclass
class QwenImageRunConfig(WanRunConfig):
    """A Qwen-Image run: the same sections, the model a `QwenImageTransformer2DModel` shape; the
    data are images (1-frame latents, the demo takes each video's first frame) with their real
    text tokens (`data.text_len` does not apply); `boundary_ratio`, context parallel and
    first-frame conditioning are Wan's. The flow defaults are the published Qwen-Image recipe's:
    trained unshifted (diffusers' train_dreambooth_lora_qwen_image.py), sampled with the
    size-dependent shift (QwenImagePipeline)."""

    recipe: str = "diffusion.qwen_image"
    model: QwenImageConfig = field(default_factory=QwenImageConfig)
    flow: FlowMatchingConfig = field(default_factory=lambda: FlowMatchingConfig(shift=1.0, sampling_shift="dynamic"))
