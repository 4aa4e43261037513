"""hookloop: a thin training loop on Accelerate whose every variable part is a
pluggy hook.

    from hookloop import Loop, Network, hookimpl
"""

from ._version import __version__ as __version__
from .errors import PluginLoadError, PluginValidationError
from .loop import Loop
from .markers import hookimpl, hookspec
from .network import NOT_MEASURED, Network
from .state import LoopState
from .strategies import StepOutput

__all__ = [
    "Loop",
    "LoopState",
    "NOT_MEASURED",
    "Network",
    "PluginLoadError",
    "PluginValidationError",
    "StepOutput",
    "hookimpl",
    "hookspec",
]
