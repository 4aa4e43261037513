"""Stop cleanly when the scheduler says so: the signal handling the
``preemption`` plugin (:mod:`hookloop.plugins.preemption`) acts on.

A cluster scheduler (SLURM, Kubernetes) preempts a job by sending a signal
and, after a grace period, SIGKILL. :class:`SignalWatcher` turns the first
signal into a flag, read at the loop's safe points: the current update
finishes, a checkpoint is saved and :class:`Preempted` ends the process with
:data:`PREEMPTED_EXIT_CODE`. With several processes the signal may reach the
ranks at different steps (or only one): :meth:`SignalWatcher.agreed` takes the
maximum of the ranks' flags (one all-reduce of an int on a CPU group) at steps
every rank reaches, so that all stop after the same step.
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
#: SIGUSR1: SLURM's warning before the time limit (``#SBATCH --signal=USR1@90``), as
#: Lightning's ``SLURMEnvironment`` takes it (where the platform has it)
DEFAULT_SIGNALS = tuple(s for s in ("SIGTERM", "SIGINT", "SIGUSR1") if hasattr(signal, s))


class Preempted(SystemExit):
    """Training stopped on a signal after saving a checkpoint. A
    ``SystemExit``: uncaught, the interpreter exits with status 75 without a
    traceback; ``except Exception`` does not catch it. ``on_exception`` hooks
    run before it leaves :meth:`Loop.fit`; ``on_fit_end`` does not.

    :ivar signal: the signal number that asked for the stop.
    :ivar global_step: the step after which the run stopped.
    :ivar checkpoint: the directory of the checkpoint saved for the stop.
    """

    def __init__(self, signum: int, global_step: int, checkpoint=None):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.signal, self.global_step, self.checkpoint = signum, global_step, checkpoint

    def __str__(self):
        where = f"; checkpoint {self.checkpoint}" if self.checkpoint else ""
        return (f"stopped by {signal_name(self.signal)} after step {self.global_step}{where}; exit status "
                f"{PREEMPTED_EXIT_CODE}: requeue and resume with resume_from='latest'")


def signal_name(signum) -> str:
    try:
        return signal.Signals(signum).name
    except (ValueError, TypeError):
        return str(signum)


class SignalWatcher:
    """Records the first of ``signals`` (names or numbers) received while
    installed. Every installed watcher of a process (one per loop) shares one
    set of handlers: the first :meth:`install` puts them in place, the last
    :meth:`uninstall` puts back those from before. A second SIGINT while a
    stop is pending raises ``KeyboardInterrupt`` at once. Outside a fit a
    watcher whose :attr:`immediate` is set acts in the handler itself (there
    is no safe point to wait for)."""

    def __init__(self, signals: Any = DEFAULT_SIGNALS) -> None:
        self.signals = tuple(getattr(signal, s) if isinstance(s, str) else signal.Signals(s) for s in signals)
        #: the first signal received (its number), or None
        self.received: int | None = None
        #: called with the signal number from the handler, when set (outside
        #: a fit); None: only record it, for a safe point to act on
        self.immediate: Callable[[int], None] | None = None
        self.installed = False
        self._group: Any = _UNSET  # the CPU process group the flag is reduced on

    def install(self) -> bool:
        """Install the handlers (main thread only: Python delivers signals
        there; elsewhere this does nothing and returns False)."""
        if self.installed or threading.current_thread() is not threading.main_thread():
            return self.installed
        self.received, self.installed = None, True
        _HUB.add(self)
        return True

    def start_fit(self) -> None:
        """A fit begins: signals wait for its safe points; no stop is pending."""
        self.immediate = self.received = None

    def uninstall(self) -> None:
        if self.installed:
            self.installed = False
            _HUB.remove(self)

    def agreed(self, accelerator) -> int | None:
        """The signal every rank agrees to stop on, or None. One process: the
        flag (free). Several: the maximum over ranks, one all-reduce of an int
        on a CPU group; every rank must call it at the same step."""
        if accelerator.num_processes <= 1:
            return self.received
        if self._group is _UNSET:
            self._group = _cpu_group()
        if self._group is False:
            return self.received
        flag = torch.tensor([self.received or 0], dtype=torch.int64)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self._group)
        return int(flag) or None


class _Hub:
    """The process's one set of handlers for every installed watcher, held
    weakly (a loop dropped without ``close()`` is not kept alive; once no
    watcher of a signal is left the previous handler is back)."""

    def __init__(self):
        self._watchers: list = []  # weak references, in install order
        self.previous: dict = {}  # signal -> the handler from before the first watcher

    @property
    def watchers(self) -> list[SignalWatcher]:
        return [w for w in (ref() for ref in self._watchers) if w is not None]

    def add(self, watcher) -> None:
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

    def _handle(self, signum, frame):
        targets = [w for w in self.watchers if signum in w.signals]
        if not targets:  # every watcher of it is gone: the previous handler gets it
            self._restore_unneeded()
            signal.raise_signal(signum)
            return
        if signum == signal.SIGINT and any(w.received is not None for w in targets):
            raise KeyboardInterrupt
        for watcher in targets:
            watcher.received = watcher.received or signum
        if all(w.immediate is not None for w in targets):
            targets[0].immediate(signum)  # no fit to stop at a safe point: act now


#: the process-wide handlers (one per process, whatever the number of watchers)
_HUB = _Hub()
_UNSET = object()


def _cpu_group() -> torch.distributed.ProcessGroup | bool | None:
    """A process group that reduces CPU tensors (the default group if gloo,
    else a new gloo one: the flag never touches a GPU); False without
    torch.distributed."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
