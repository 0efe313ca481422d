"""Robot-learning datasets read without their reference libraries, and what a policy does to them.

`LeRobotDataset` reads local LeRobot datasets (codebase v2.1 and v3.0: parquet with pyarrow,
video with PyAV) by global frame index, with LeRobot's `delta_timestamps` windows.

`Normalizer` normalizes and unnormalizes features per `NormMode` (LeRobot's IDENTITY, MEAN_STD,
MIN_MAX, QUANTILES, QUANTILE10) from a dataset's stats, and saves as JSON for serving;
`compute_stats` computes mean/std/min/max/count and the q01..q99 quantiles from the parquet data.

`resize_with_pad` is openpi's resize-and-pad; `adjust_brightness`, `adjust_contrast`,
`adjust_saturation`, `adjust_hue`, `adjust_sharpness` (torchvision's, after PIL's ImageEnhance),
`crop_resize` and `rotate` are the augmentations that `ImageAugment` configures and
`ImageAugmenter` applies from a `torch.Generator`.

`DatasetMixture` draws from several datasets by weight, as a stream that depends only on
(seed, position), so a resumed run draws what the uninterrupted one would; `check_compatible`
checks that they agree on the features a policy reads.

`write_demo_dataset` writes a small, learnable LeRobot v3.0 dataset (a 2-D point robot moving to
a red or a blue square, two cameras), atomically, for demos and tests.
"""

from loongforge.core.data.mixture import DatasetMixture
from loongforge.embodied.data.compatible import check_compatible
from loongforge.embodied.data.demo_dataset import write_demo_dataset
from loongforge.embodied.data.image_transforms import (
    ImageAugment,
    ImageAugmenter,
    adjust_brightness,
    adjust_contrast,
    adjust_hue,
    adjust_saturation,
    adjust_sharpness,
    crop_resize,
    resize_with_pad,
    rgb_to_grayscale,
    rotate,
)
from loongforge.embodied.data.lerobot_dataset import LeRobotDataset
from loongforge.embodied.data.lerobot_meta import SUPPORTED_VERSIONS, Episode, VideoSpan
from loongforge.embodied.data.normalize import Normalizer, NormMode, compute_stats

__all__ = [
    "SUPPORTED_VERSIONS",
    "DatasetMixture",
    "Episode",
    "ImageAugment",
    "ImageAugmenter",
    "LeRobotDataset",
    "NormMode",
    "Normalizer",
    "VideoSpan",
    "adjust_brightness",
    "adjust_contrast",
    "adjust_hue",
    "adjust_saturation",
    "adjust_sharpness",
    "check_compatible",
    "compute_stats",
    "crop_resize",
    "resize_with_pad",
    "rgb_to_grayscale",
    "rotate",
    "write_demo_dataset",
]
