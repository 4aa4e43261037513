"""Every rank fails together: a step that any process may fail (a refused
save, a file one rank cannot read) is followed by one agreement, so that
all processes raise the same :class:`CheckpointError` instead of some
waiting forever in the next collective call.

    with every_rank(acc):                 # raise on every rank if any failed
        staged = stage(path)

    with every_rank(raise_error=False) as outcome:    # or only find out
        staged = stage(candidate)
    if outcome.error is None: ...

With one process there is no communication; with several, one
``gather_object`` of each rank's error message (or None).
"""

from __future__ import annotations

import contextlib

from . import accelerate as accel
from .errors import CheckpointError


class Outcome:
    """What :func:`every_rank` agreed: ``error`` is the first failing rank's
    message, or None if every rank succeeded (set when the block ends)."""

    error: str | None = None


def agree(error=None, acc=None, *, raise_error: bool = True) -> str | None:
    """Tell every rank whether any failed; a barrier with several processes.

    ``error``: this rank's None, message or exception. Returns the first
    failing rank's message (None: none failed); with ``raise_error``, raises
    instead: the exception itself on the rank that had one, else a
    :class:`CheckpointError` with that message. ``acc``: the accelerator, or
    None for Accelerate's process state."""
    local = error if isinstance(error, BaseException) else None
    message = None if error is None else str(error)
    if (acc.num_processes if acc is not None else accel.process_count()) > 1:
        from accelerate.utils import gather_object

        errors = [e for e in gather_object([message]) if e]
        message = errors[0] if errors else None
    if raise_error:
        if local is not None:
            raise local
        if message:
            raise CheckpointError(message)
    return message


@contextlib.contextmanager
def every_rank(acc=None, *, catch=(CheckpointError,), describe=None, raise_error: bool = True):
    """Run the block on every rank, then :func:`agree` whether it failed
    anywhere. An exception of a ``catch`` type ends the block on its rank;
    ``describe(exc)`` may turn it into a message (default: the exception
    itself, raised as it is on its rank). Other exceptions pass through
    without an agreement, as from any code. Yields an :class:`Outcome`;
    ``raise_error=False``: nothing is raised, ``outcome.error`` tells."""
    outcome = Outcome()
    error = None
    try:
        yield outcome
    except catch as exc:
        error = exc if describe is None else describe(exc)
    outcome.error = agree(error, acc, raise_error=raise_error)
