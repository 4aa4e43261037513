"""Stop cleanly when the scheduler says so: SIGTERM / SIGINT handling, from
``Loop(...)`` on.

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
import weakref
from collections.abc import Callable
from typing import Any

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
    installed.

    Every installed watcher of a process shares one set of signal handlers
    (:data:`_HUB`): the first :meth:`install` puts them in place, the last
    :meth:`uninstall` puts back the handlers that were there before; a
    signal sets the flag of *every* installed watcher that asked for it. So
    two ``Checkpoint`` plugins both see a SIGTERM (both save), and ending a
    fit restores the handlers whatever order the plugins uninstall in.
    Once one watcher has agreed on a stop (:meth:`agreed`), the others
    return that stop without communicating (:attr:`shared_stop`).

    A second SIGINT while a stop is pending raises ``KeyboardInterrupt`` at
    once (a user pressing Ctrl-C twice wants out now; the checkpoint being
    written, if any, is left as a temporary directory that the next run
    ignores).

    Outside a fit there is no safe point to wait for: a watcher whose
    :attr:`immediate` is set acts in the handler itself (the ``Checkpoint``
    plugin raises :class:`Preempted` there: status 75 during start-up,
    ``load_checkpoint``, or an ``evaluate`` / ``predict`` after ``fit``),
    unless another installed watcher of the signal is inside a fit, which
    then stops at its next safe point.
    """

    def __init__(self, signals: Any = DEFAULT_SIGNALS) -> None:
        self.signals = tuple(
            getattr(signal, s) if isinstance(s, str) else signal.Signals(s) for s in signals
        )
        #: the first signal received (its number), or None
        self.received: int | None = None
        #: called with the signal number from the handler, when set (outside
        #: a fit); None: only record it, for a safe point to act on
        self.immediate: Callable[[int], None] | None = None
        self._installed = False
        self._group = _UNSET  # the CPU process group the flag is reduced on

    @property
    def installed(self) -> bool:
        return self._installed

    def install(self) -> bool:
        """Install the handlers (main thread only: Python delivers signals
        there; elsewhere this does nothing and returns False)."""
        if self._installed or threading.current_thread() is not threading.main_thread():
            return self._installed
        self.received = None
        _HUB.add(self)
        self._installed = True
        return True

    def start_fit(self) -> None:
        """A fit begins: signals wait for its safe points; no stop is pending."""
        self.immediate = None
        self.received = None
        _HUB.agreed = None

    def uninstall(self) -> None:
        """Stop watching; the last watcher out puts the previous handlers back."""
        if self._installed:
            self._installed = False
            _HUB.remove(self)

    @property
    def shared_stop(self) -> int | None:
        """The stop some installed watcher of this process already agreed on
        (every rank agreed on it at the same point), or None. Free."""
        return _HUB.agreed if self._installed else None

    def agreed(self, accelerator) -> int | None:
        """The signal every rank agrees to stop on, or None. One process: the
        local flag (no communication). Several: the maximum over ranks, one
        all-reduce of an int on a CPU group; every rank must call this at the
        same step (the first call also creates the group: a collective).
        A stop another watcher already agreed on is returned without
        communicating."""
        if self.shared_stop is not None:
            return self.shared_stop
        if accelerator.num_processes <= 1:
            value = self.received
        else:
            if self._group is _UNSET:
                self._group = _cpu_group()
            if self._group is False:
                value = self.received
            else:
                flag = torch.tensor([self.received or 0], dtype=torch.int64)
                torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self._group)
                value = int(flag) or None
        if value is not None and self._installed:
            _HUB.agreed = value
        return value


class _Hub:
    """The process's one set of handlers for every installed
    :class:`SignalWatcher`. Watchers are held weakly: a loop dropped without
    ``close()`` does not keep its watcher (or itself) alive, and once no
    watcher of a signal is left the previous handler is back."""

    def __init__(self):
        self._watchers: list = []  # weak references, in install order
        #: signal -> the handler that was there before the first watcher
        self.previous: dict = {}
        #: a stop some watcher agreed on during the current fit
        self.agreed: int | None = None

    @property
    def watchers(self) -> list[SignalWatcher]:
        return [w for w in (ref() for ref in self._watchers) if w is not None]

    def add(self, watcher) -> None:
        if not self.watchers:
            self.agreed = None
        self._watchers.append(weakref.ref(watcher))
        for sig in watcher.signals:
            if sig not in self.previous:
                self.previous[sig] = signal.getsignal(sig)
                signal.signal(sig, self._handle)

    def remove(self, watcher) -> None:
        self._watchers = [ref for ref in self._watchers if ref() is not None and ref() is not watcher]
        self._restore_unneeded()

    def _restore_unneeded(self) -> None:
        needed = {sig for w in self.watchers for sig in w.signals}
        for sig in [s for s in self.previous if s not in needed]:
            handler = self.previous.pop(sig)
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        if not self.watchers:
            self.agreed = None

    def _handle(self, signum, frame):
        targets = [w for w in self.watchers if signum in w.signals]
        if not targets:  # every watcher of it is gone: the previous handler gets it
            self._restore_unneeded()
            signal.raise_signal(signum)
            return
        if signum == signal.SIGINT and any(w.received is not None for w in targets):
            raise KeyboardInterrupt
        for watcher in targets:
            if watcher.received is None:
                watcher.received = signum
        if all(w.immediate is not None for w in targets):
            targets[0].immediate(signum)  # no fit to stop at a safe point: act now


#: the process-wide handlers (one per process, whatever the number of watchers)
_HUB = _Hub()


_UNSET = object()


def _cpu_group() -> torch.distributed.ProcessGroup | bool | None:
    """A process group that reduces CPU tensors: the default group if it is
    gloo, else a new gloo group (so that the stop flag never touches, or
    synchronises, a GPU). ``False`` when torch.distributed is not set up."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return False
    if dist.get_backend() == "gloo":
        return None  # the default group
    return dist.new_group(backend="gloo")
