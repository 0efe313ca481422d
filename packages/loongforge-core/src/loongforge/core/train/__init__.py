"""The one training loop every stack drives, with its schedules, metrics and hooks."""

from loongforge.core.train.lr import lr_at
from loongforge.core.train.trainer import Trainer, TrainHooks

__all__ = ["lr_at", "Trainer", "TrainHooks"]
