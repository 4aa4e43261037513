"""Exceptions hookloop raises. Each message names the culprit."""

import pluggy


class PluginValidationError(pluggy.PluginValidationError):
    """A plugin cannot be registered: raised by ``Loop(...)`` before training.

    Subclasses pluggy's own error so that code catching pluggy's still works.
    """

    def __init__(self, plugin, message):
        super().__init__(plugin, message)


class PluginLoadError(ImportError):
    """An installed plugin (an entry point in the ``hookloop`` group) could
    not be imported or instantiated."""

    def __init__(self, message, *, distribution=None, entry_point=None):
        super().__init__(message)
        self.distribution = distribution
        self.entry_point = entry_point
