"""Built-in plugins, one small file each.

``BUILTINS`` maps the names a user may give in ``Loop(plugins=["name"])`` (or
``("name", {options})``) to the class.
"""

from .gradclip import GradClip
from .logger import Logger
from .loss import DefaultLoss
from .progress import ProgressBar

BUILTINS = {
    "gradclip": GradClip,
    "logger": Logger,
    "loss": DefaultLoss,
    "progress": ProgressBar,
}

__all__ = ["BUILTINS", "DefaultLoss", "GradClip", "Logger", "ProgressBar"]
