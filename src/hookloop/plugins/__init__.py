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
from .progress import ProgressBar
from .sample_grid import SampleGrid

BUILTINS = {
    "checkpoint": Checkpoint,
    "finite": FiniteCheck,
    "gradclip": GradClip,
    "logger": Logger,
    "loss": DefaultLoss,
    "metrics": DefaultMetrics,
    "progress": ProgressBar,
    "samples": SampleGrid,
}

__all__ = ["BUILTINS", "Checkpoint", "FiniteCheck", "NonFiniteLoss", "DefaultLoss", "DefaultMetrics", "GradClip", "Logger", "ProgressBar", "SampleGrid"]
