"""Every rank fails together: a step that any process may fail (a refused
save, a file one rank cannot read) ends with one agreement (one
``gather_object`` of each rank's error message; nothing with one process),
so that every process raises the same :class:`CheckpointError` instead of
some waiting forever in the next collective call."""

from __future__ import annotations

import contextlib

from . import accelerate as accel
from .errors import CheckpointError


class Outcome:
    """What :func:`every_rank` agreed: the first failing rank's message, or None."""

    error: str | None = None


def agree(error=None, acc=None, *, raise_error: bool = True) -> str | None:
    """Tell every rank whether any failed (``error``: this rank's None,
    message or exception); a barrier with several processes. Returns the first
    failing rank's message; with ``raise_error``, raises it instead (the
    exception itself on the rank that had one)."""
    message = None if error is None else str(error)
    if (acc.num_processes if acc is not None else accel.process_count()) > 1:
        from accelerate.utils import gather_object

        message = next((e for e in gather_object([message]) if e), None)
    if raise_error and isinstance(error, BaseException):
        raise error
    if raise_error and message:
        raise CheckpointError(message)
    return message


@contextlib.contextmanager
def every_rank(acc=None, *, catch=(CheckpointError,), describe=None, raise_error: bool = True):
    """Run the block on every rank, then :func:`agree` whether it failed
    anywhere. An exception of a ``catch`` type ends the block on its rank
    (``describe(exc)`` may turn it into a message); others pass through
    without an agreement. Yields an :class:`Outcome` (``raise_error=False``:
    nothing is raised, ``outcome.error`` tells)."""
    outcome, error = Outcome(), None
    try:
        yield outcome
    except catch as exc:
        error = exc if describe is None else describe(exc)
    outcome.error = agree(error, acc, raise_error=raise_error)
