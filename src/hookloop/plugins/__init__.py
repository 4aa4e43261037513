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
from .profiler import Profiler
from .throughput import ThroughputMonitor
from .timer import Timer
from .track_metrics import TrackMetrics
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
    # not "profiler": the installed hookloop-profiler (hook timings) is named so
    "torch-profiler": Profiler,
    "throughput": ThroughputMonitor,
    "timer": Timer,
    "track-metrics": TrackMetrics,
    "train-loss": TrainLoss,
    "trainer-callbacks": TrainerCallbacks,
}


def loop_defaults() -> list[object]:
    """The built-in defaults every ``Loop`` registers after its strategy's
    (unless given by name or blocked): fresh instances."""
    return [ProgressBar(), FiniteCheck(), TrackMetrics()]


__all__ = ["BUILTINS", "Checkpoint", "FiniteCheck", "NonFiniteLoss", "DefaultLoss", "DefaultMetrics", "GradClip",
           "Logger", "Preemption", "ProgressBar", "SampleGrid", "TrackMetrics"]
__all__ += ["GradientAccumulationScheduler", "LambdaCallback", "LearningRateMonitor", "ModelSummary",
            "Profiler", "ThroughputMonitor", "Timer", "TrainLoss"]
