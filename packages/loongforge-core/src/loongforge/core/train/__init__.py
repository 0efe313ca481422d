"""The one training loop every stack drives: the task contract, the trainer, LR schedules."""

from loongforge.core.train.lr import lr_at
from loongforge.core.train.task import TrainingTask
from loongforge.core.train.trainer import StepResult, Trainer

__all__ = ["lr_at", "TrainingTask", "StepResult", "Trainer"]
