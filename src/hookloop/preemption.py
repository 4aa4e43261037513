"""Stop cleanly when the scheduler says so: SIGTERM / SIGINT handling.

A cluster scheduler (SLURM, Kubernetes) preempts a job by sending SIGTERM and,
after a grace period, SIGKILL. :class:`SignalWatcher` turns the first SIGTERM
or SIGINT into a flag; the :class:`~hookloop.plugins.Checkpoint` plugin reads
it after every step, lets the current optimizer step finish, saves a
checkpoint and raises :class:`Preempted`, which ends the process with
:data:`PREEMPTED_EXIT_CODE` unless the script catches it.

With several processes the signal may reach the ranks at different steps (or
reach only one): :meth:`SignalWatcher.agreed` takes the maximum of every
rank's flag with one all-reduce of a single int on a CPU (gloo) group, at
steps every rank reaches, so that all ranks stop after the same step.
"""

from __future__ import annotations

import os
import signal
import threading

import torch

#: The exit status of a process ended by :class:`Preempted`: ``EX_TEMPFAIL``
#: from ``sysexits.h``, "temporary failure, the user is invited to retry".
#: Not 143 (128 + SIGTERM): that is what a shell reports for a process
#: *killed* by SIGTERM, so a wrapper could not tell "checkpoint saved, requeue
#: me" from "killed before anything was saved".
PREEMPTED_EXIT_CODE = getattr(os, "EX_TEMPFAIL", 75)

#: the signals handled by default
DEFAULT_SIGNALS = ("SIGTERM", "SIGINT")


class Preempted(SystemExit):
    """Training stopped on a signal after saving a checkpoint.

    A ``SystemExit``: uncaught, the interpreter exits with
    :data:`PREEMPTED_EXIT_CODE` (75) without a traceback; ``except
    Exception`` does not catch it. ``on_exception`` hooks run before it
    leaves :meth:`Loop.fit`; ``on_fit_end`` does not.

    :ivar signal: the signal number that asked for the stop.
    :ivar global_step: the step after which the run stopped.
    :ivar checkpoint: the directory of the checkpoint saved for the stop.
    """

    def __init__(self, signum: int, global_step: int, checkpoint=None):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.signal = signum
        self.global_step = global_step
        self.checkpoint = checkpoint

    def __str__(self):
        where = f"; checkpoint {self.checkpoint}" if self.checkpoint else ""
        return (
            f"stopped by {signal_name(self.signal)} after step {self.global_step}{where}; "
            f"exit status {PREEMPTED_EXIT_CODE}: requeue and resume with resume_from='latest'"
        )


def signal_name(signum) -> str:
    try:
        return signal.Signals(signum).name
    except (ValueError, TypeError):
        return str(signum)


class SignalWatcher:
    """Records the first of ``signals`` (names or numbers) received while
    installed; the handlers it replaced are put back by :meth:`uninstall`.

    A second SIGINT while a stop is pending raises ``KeyboardInterrupt`` at
    once (a user pressing Ctrl-C twice wants out now; the checkpoint being
    written, if any, is left as a temporary directory that the next run
    ignores).
    """

    def __init__(self, signals=DEFAULT_SIGNALS):
        self.signals = tuple(
            getattr(signal, s) if isinstance(s, str) else signal.Signals(s) for s in signals
        )
        #: the first signal received (its number), or None
        self.received: int | None = None
        self._previous: dict = {}
        self._group = _UNSET  # the CPU process group the flag is reduced on

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def install(self) -> bool:
        """Install the handlers (main thread only: Python delivers signals
        there; elsewhere this does nothing and returns False)."""
        if self._previous or threading.current_thread() is not threading.main_thread():
            return bool(self._previous)
        self.received = None
        for sig in self.signals:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handle)
        return True

    def uninstall(self) -> None:
        """Put the previous handlers back."""
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)

    def _handle(self, signum, frame):
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if self.received is None:
            self.received = signum

    def agreed(self, accelerator) -> int | None:
        """The signal every rank agrees to stop on, or None. One process: the
        local flag (no communication). Several: the maximum over ranks, one
        all-reduce of an int on a CPU group; every rank must call this at the
        same step (the first call also creates the group: a collective)."""
        if accelerator.num_processes <= 1:
            return self.received
        if self._group is _UNSET:
            self._group = _cpu_group()
        if self._group is False:
            return self.received
        flag = torch.tensor([self.received or 0], dtype=torch.int64)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self._group)
        value = int(flag)
        return value or None


_UNSET = object()


def _cpu_group():
    """A process group that reduces CPU tensors: the default group if it is
    gloo, else a new gloo group (so that the stop flag never touches, or
    synchronises, a GPU). ``False`` when torch.distributed is not set up."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return False
    if dist.get_backend() == "gloo":
        return None  # the default group
    return dist.new_group(backend="gloo")
