"""Exceptions hookloop raises. Each message names the culprit."""

from __future__ import annotations

import pluggy


class PluginValidationError(pluggy.PluginValidationError):
    """A plugin cannot be registered: raised by ``Loop(...)`` before training.

    Subclasses pluggy's own error so that code catching pluggy's still works.
    """

    def __init__(self, plugin: object, message: str) -> None:
        super().__init__(plugin, message)


class PluginLoadError(ImportError):
    """An installed plugin (an entry point in the ``hookloop`` group) could
    not be imported or instantiated."""

    def __init__(self, message: str, *, distribution: str | None = None,
                 entry_point: str | None = None) -> None:
        super().__init__(message)
        self.distribution = distribution
        self.entry_point = entry_point


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``; on Python 3.10 the same ``__notes__`` list,
    which the ``exceptiongroup`` backport prints in tracebacks."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
        return
    notes = getattr(exc, "__notes__", None)
    if not isinstance(notes, list):
        notes = []
    notes.append(note)
    exc.__notes__ = notes  # type: ignore[attr-defined]  # Python 3.10: no __notes__ declared
    import sys

    if sys.version_info < (3, 11):
        try:
            import exceptiongroup  # type: ignore[import-not-found, unused-ignore]  # noqa: F401 - patches traceback printing of __notes__
        except ImportError:
            pass
