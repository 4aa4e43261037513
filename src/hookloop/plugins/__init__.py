"""Built-in plugins, one small file each.

``BUILTINS`` maps the names a user may give in ``Loop(plugins=["name"])`` (or
``("name", {options})``) to the class.
"""

from .checkpoint import Checkpoint
from .finite import FiniteCheck, NonFiniteLoss
from .gradclip import GradClip
from .logger import Logger
from .loss import DefaultLoss
from .metrics import DefaultMetrics
from .preemption import Preemption
from .progress import ProgressBar
from .sample_grid import SampleGrid
from .accumulation import GradientAccumulationScheduler
from .lambda_callback import LambdaCallback
from .lr_monitor import LearningRateMonitor
from .model_summary import ModelSummary
from .throughput import ThroughputMonitor
from .timer import Timer
from .train_loss import TrainLoss
from ..adapters.transformers import TrainerCallbacks  # imports transformers only when created

BUILTINS = {
    "checkpoint": Checkpoint,
    "finite": FiniteCheck,
    "gradclip": GradClip,
    "logger": Logger,
    "loss": DefaultLoss,
    "metrics": DefaultMetrics,
    "preemption": Preemption,
    "progress": ProgressBar,
    "samples": SampleGrid,
    "accumulation-scheduler": GradientAccumulationScheduler,
    "lambda": LambdaCallback,
    "lr-monitor": LearningRateMonitor,
    "model-summary": ModelSummary,
    "throughput": ThroughputMonitor,
    "timer": Timer,
    "train-loss": TrainLoss,
    "trainer-callbacks": TrainerCallbacks,
}

__all__ = ["BUILTINS", "Checkpoint", "FiniteCheck", "NonFiniteLoss", "DefaultLoss", "DefaultMetrics", "GradClip",
           "Logger", "Preemption", "ProgressBar", "SampleGrid"]
__all__ += ["GradientAccumulationScheduler", "LambdaCallback", "LearningRateMonitor", "ModelSummary",
            "ThroughputMonitor", "Timer", "TrainLoss"]
