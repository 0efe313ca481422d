"""One checkpoint layout for every stack.

    <run_dir>/checkpoints/
        latest                 name of the newest complete step directory (moved last)
        step_00000100/
            manifest.json      format version, step, config, parallel layout, data and RNG
                               state, sha256 of every other file
            ...                weight/optimizer shards (megatron-core dist_checkpointing)

A step directory is written under a temporary name and renamed into place; `latest` is
replaced atomically after that, so a crash never leaves a broken newest checkpoint.
"""

from loongforge.core.checkpoint.layout import (
    FORMAT_VERSION,
    CheckpointDir,
    checkpoint_manifest,
    find_checkpoint,
    read_manifest,
    verify_files,
)
from loongforge.core.checkpoint.megatron_io import load_full_state, load_megatron, save_megatron

__all__ = [
    "FORMAT_VERSION",
    "CheckpointDir",
    "checkpoint_manifest",
    "find_checkpoint",
    "read_manifest",
    "verify_files",
    "load_full_state",
    "load_megatron",
    "save_megatron",
]
