"""Robot-learning datasets read without their reference libraries.

`LeRobotDataset` reads local LeRobot datasets (codebase v2.1 and v3.0: parquet with pyarrow,
video with PyAV) by global frame index, with LeRobot's `delta_timestamps` windows.
"""

from loongforge.embodied.data.lerobot_dataset import LeRobotDataset
from loongforge.embodied.data.lerobot_meta import SUPPORTED_VERSIONS, Episode, VideoSpan

__all__ = ["SUPPORTED_VERSIONS", "Episode", "LeRobotDataset", "VideoSpan"]
