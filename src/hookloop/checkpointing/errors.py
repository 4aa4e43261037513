"""The errors of the checkpoint package: what a failed write or read raises."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint cannot be written or read back: the message names the
    directory and the culprit (a file, a network's tensor, a plugin)."""


class NotACheckpointName(CheckpointError):
    """``latest`` holds a plain name that is not a checkpoint's: a temporary
    folder (``.tmp-...``), a deleted one (``.trash-...``) or anything else.
    ``resume_from="latest"`` then falls back to the newest usable checkpoint."""


class NonFiniteCheckpoint(CheckpointError):
    """A save was refused: a network's parameter or optimizer state holds a
    NaN or an infinity. Nothing was written; ``latest`` still names the last
    finite checkpoint.

    :ivar network: the network whose tensor is not finite.
    :ivar tensor: which tensor (``"parameter '0.weight'"``, ``"optimizer state
        'exp_avg' of parameter '0.weight'"``).
    :ivar step: the ``global_step`` of the refused save.
    :ivar first_bad: ``(update, network, what)`` of the first update seen with a
        non-finite gradient norm (from ``GradClip``), or None if unknown.
    """

    def __init__(self, message, *, network=None, tensor=None, step=None, first_bad=None):
        super().__init__(message)
        self.network = network
        self.tensor = tensor
        self.step = step
        self.first_bad = first_bad


def first_line(exc) -> str:
    """The first line of an exception's message (at most 300 characters), for
    an error that quotes what a library said."""
    lines = str(exc).strip().splitlines()
    return lines[0][:300] if lines else type(exc).__name__
