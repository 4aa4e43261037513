"""Stop cleanly when the scheduler says so: a signal (SIGTERM, SIGUSR1,
SIGINT) asks every checkpoint plugin for a save at the next safe point, then
the process ends with status 75 (:mod:`hookloop.preemption`). Registered with
every :class:`~hookloop.plugins.Checkpoint` (its ``hookloop_plugins``);
``block=["preemption"]`` leaves signal handling alone."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

from .. import checkpointing
from ..checkpointing.writer import wait
from ..markers import hookimpl
from ..preemption import Preempted, SignalWatcher, signal_name
from ..protocols import LoopLike

#: written into the checkpoint roots when a signal ends the process (status 75)
PREEMPTED_MARKER = "PREEMPTED"


class Preemption:
    """The first signal of the checkpoint plugins' ``signals`` (handlers
    installed from ``Loop(...)`` on, given back by ``loop.close()``):

    - during a fit, the current update and its evaluation finish, every
      checkpoint plugin saves at the safe point (synchronously),
      ``on_exception`` hooks run and :class:`~hookloop.preemption.Preempted`
      is raised: uncaught, the process exits with status 75. With several
      processes the ranks agree on the stop (one all-reduce of an int at the
      safe points of every ``signal_check_every``-th update and at epoch
      ends), so that all stop after the same update. A signal during the
      fit's final save also ends with status 75;
    - outside a fit (start-up, ``load_checkpoint``, an ``evaluate`` /
      ``predict`` after ``fit``) there is nothing new to save: ``Preempted``
      at once, naming the last checkpoint.

    The main process writes ``<root>/PREEMPTED`` (what a requeue wrapper under
    a launcher, which reports its own status, looks for); the next fit there
    removes it.
    """

    name = "preemption"
    changes_training = False

    def __init__(self) -> None:
        #: records the stop signal; ``watcher.received`` is this process's flag (None: inert)
        self.watcher: SignalWatcher | None = None
        self._policies: list[Any] = []

    @hookimpl
    def on_loop_start(self, loop: LoopLike) -> None:
        self._policies = [p for p in checkpointing.checkpoint_plugins(loop) if p.signals]
        signals = list(dict.fromkeys(s for p in self._policies for s in p.signals))
        if signals:
            self.watcher = SignalWatcher(signals)
            if self.watcher.install():
                self.watcher.immediate = self._outside_fit(loop)

    @hookimpl
    def on_loop_end(self) -> None:
        if self.watcher is not None:
            self.watcher.uninstall()
            self.watcher.immediate = None

    @hookimpl
    def on_fit_start(self, loop: LoopLike) -> None:
        if self.watcher is None:
            return
        if loop.accelerator.is_main_process:
            for policy in self._policies:  # resumed: that preemption is over
                (policy.directory(loop) / PREEMPTED_MARKER).unlink(missing_ok=True)
        self.watcher.install()
        self.watcher.start_fit()  # during the fit: at the next safe point, after saving

    @hookimpl(wrapper=True)
    def on_safe_point(self, loop: LoopLike, epoch_end: bool) -> Generator[None, Any, Any]:
        stop = None
        if self.watcher is not None:
            every = min(p.signal_check_every for p in self._policies)
            if epoch_end or loop.accelerator.num_processes == 1 or loop.state.global_step % every == 0:
                stop = self.watcher.agreed(loop.accelerator)
            for policy in self._policies if stop is not None else ():
                policy.request("preempted")  # every checkpoint plugin saves for the stop
        result = yield
        if stop is not None:
            self._stop(loop, stop)
        return result

    @hookimpl(wrapper=True)  # after every plugin's end of the fit (the final save is on disk)
    def on_fit_end(self, loop: LoopLike) -> Generator[None, Any, Any]:
        try:
            result = yield
            # a signal that came during the fit's last safe point: that save is the stop's checkpoint
            stop = self.watcher.agreed(loop.accelerator) if self.watcher is not None else None
        finally:
            self._after_fit(loop)
        if stop is not None:
            self._stop(loop, stop)
        return result

    @hookimpl(wrapper=True)
    def on_exception(self, loop: LoopLike) -> Generator[None, Any, Any]:
        try:
            return (yield)
        finally:
            self._after_fit(loop)

    def _last(self, loop: LoopLike) -> Path | None:
        return next((p.last_saved for p in reversed(self._policies) if p.last_saved), loop.resumed_from)

    def _stop(self, loop: LoopLike, signum: int) -> None:
        wait(loop)
        step, path = loop.state.global_step, self._last(loop)
        self._mark(loop, signum, path)
        loop.print(f"hookloop: {signal_name(signum)} received: saved {path} after step {step}; "
                   f"exiting with status {Preempted(signum, step).code}", file=sys.stderr)
        raise Preempted(signum, step, path)

    def _after_fit(self, loop: LoopLike) -> None:
        """From the end of a fit on, a signal ends the process at once."""
        if self.watcher is not None and self.watcher.installed:
            self.watcher.immediate = self._outside_fit(loop)

    def _outside_fit(self, loop: LoopLike) -> Callable[[int], None]:
        def preempted(signum: int) -> None:
            step, path = loop.state.global_step, self._last(loop)
            saved = f"its last checkpoint is {path}" if path is not None else "nothing was saved"
            loop.print(f"hookloop: {signal_name(signum)} received outside fit (nothing new to save; "
                       f"{saved}); exiting with status {Preempted(signum, step).code}", file=sys.stderr)
            self._mark(loop, signum, path)
            raise Preempted(signum, step, path)

        return preempted

    def _mark(self, loop: LoopLike, signum: int, path: Path | None) -> None:
        """``<root>/PREEMPTED`` of every checkpoint plugin (main process)."""
        if not loop.accelerator.is_main_process:
            return
        for policy in self._policies:
            try:
                root = policy.directory(loop)
                if root.is_dir():
                    (root / PREEMPTED_MARKER).write_text(json.dumps({
                        "signal": signal_name(signum), "global_step": loop.state.global_step,
                        "checkpoint": str(path) if path is not None else None,
                        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n")
            except OSError:
                pass  # a marker is a courtesy: the exit status still says 75
