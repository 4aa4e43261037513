"""Checkpoints every N steps and/or every epoch, and a clean stop on SIGTERM: the
policy (when, where, how many, which is best). :mod:`hookloop.checkpointing`
writes, verifies and reads; it knows this plugin only as a
:class:`~hookloop.checkpointing.CheckpointPolicy`."""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

from .. import checkpointing
from ..checkpointing import layout, lock
from ..checkpointing.collective import every_rank
from ..checkpointing.layout import NAME_PATTERN, sort_key
from ..checkpointing.policy import CheckpointPolicy
from ..checkpointing.saving import poll, rotate, wait
from ..markers import hookimpl
from ..preemption import DEFAULT_SIGNALS, Preempted, SignalWatcher, signal_name


_DEFAULT = object()  # keep_last not given: 3, or 1 with monitor
#: written into the checkpoint root when a signal ends the process (status 75)
PREEMPTED_MARKER = "PREEMPTED"


class Checkpoint(CheckpointPolicy):
    """Save the whole run with ``accelerator.save_state`` (see
    :mod:`hookloop.checkpointing` for what a checkpoint holds), atomically,
    keeping the newest ``keep_last``; resume with ``Loop(...,
    resume_from="latest")``.

    :param every_steps: save after every N-th optimizer update
        (``global_step``; None: never mid-epoch). Under gradient accumulation a save waits for the end of
        the accumulation group: partial gradients are not saved.
    :param every_epoch: save at the end of every epoch, after its evaluation
        and the other plugins' ``on_epoch_end`` (this hook is ``trylast``).
    :param keep_last: how many of this run's newest checkpoints to keep
        (None: all; default 3, or 1 with ``monitor``); another run's are never
        deleted, nor the newest finite one, nor the ``save_top_k`` best.
    :param dir: the checkpoint root. Default: a run folder of its own,
        ``<accelerator.project_dir or .>/checkpoints/version_<N>``: a run
        from scratch takes the next N (running a script twice gives
        ``version_0`` and ``version_1``, as Lightning's ``version_N``), a
        resumed run continues in its checkpoint's folder, and
        ``resume_from="latest"`` finds the newest folder's latest checkpoint.
        A ``dir`` given explicitly is the root itself; a run from scratch
        there is refused if another run's checkpoints are in it.
    :param monitor: keep the best checkpoints by this metric (a key of the
        metrics of an evaluation: the epoch-end one, or every ``eval_every``
        updates; ``train_loss`` logged with ``loop.log(on_epoch=True)``
        works too). Every evaluation that yields it saves a checkpoint
        recording the value; rotation keeps the ``save_top_k`` best and the
        ``keep_last`` newest (for resuming). :attr:`best` and
        ``loop.load_checkpoint("best")`` find the best one, also after a
        resume (the values are in the checkpoints' manifests).
    :param mode: ``"min"`` (a loss) or ``"max"`` (an accuracy).
    :param save_top_k: how many best checkpoints to keep (with ``monitor``).
    :param on_exception: also save an emergency checkpoint
        (``emergency-step-N``) when training raises. It may be taken in the
        middle of a step, so ``latest`` never names it and it is not rotated;
        one process only (with several, an error on one rank cannot be saved
        without the others).
    :param signals: the signals that stop training cleanly (None or ``()``:
        leave signal handling alone). The current update and its
        evaluation finish, a checkpoint is saved at its safe point,
        ``on_exception`` hooks run and
        :class:`~hookloop.preemption.Preempted` is raised: uncaught, the
        process exits with status 75 (``PREEMPTED_EXIT_CODE``). Every
        Checkpoint plugin of a process shares one set of handlers: all of
        them save, and the handlers from before the fit come back however it
        ends. A signal during the fit's final save also ends with status 75.
    :param signal_check_every: with several processes, agree on a stop
        at the safe points of every N-th update and at every epoch end (one
        all-reduce of an int on a CPU group, ~0.1-0.3 ms on a 2-core
        machine); one process checks its flag at every safe point, for free.
    :param trust_pickles: names of ``custom_checkpoint_<i>.pkl`` files (the
        state of objects given to ``accelerator.register_for_checkpointing``)
        that resuming may unpickle although they are not plain data.
        Unpickling runs the code a file names: trust only your own.
    :param asynchronous: copy the state to host memory at the safe point
        and write the checkpoint in a background thread while training goes
        on (at most one in flight; ``latest`` and :attr:`last_saved` name the
        previous one until it is published, :attr:`saving` the one being
        written). The fit's end, ``close()``, an exception and a preemption
        wait for it; a failed one raises a ``CheckpointError`` naming it at
        the next safe point (several processes: the next save or the fit's
        end). Costs one host copy of the weights and optimizer state.
        Default False: a save returns with the checkpoint on disk
        (docs/checkpoints.md, Asynchronous checkpoints).

    Checkpoints are written only at the loop's safe points (``on_safe_point``,
    this plugin's hook is ``trylast``): after an update and its ``eval_every``
    evaluation, and after an epoch's end, where a resume continues exactly
    what the uninterrupted run does next. Every fit also ends with a
    checkpoint of its final position, unless one was just saved there. A run
    starting from scratch, or resumed from another directory, in a directory
    that holds checkpoints not its own is refused (they would be replaced and
    rotated away). A save of non-finite weights is refused
    (:class:`~hookloop.checkpointing.NonFiniteCheckpoint`).

    While a fit runs, its main process holds the directory
    (``<dir>/hookloop.lock``, :mod:`hookloop.checkpointing.lock`): taken in
    ``on_fit_start``, its heartbeat refreshed at safe points (at most every
    30 s), released in ``on_fit_end`` / ``on_exception`` and at exit. Another
    process's ``resume_from`` of it, or a fit into it, is refused while that
    process lives; a lock whose process is gone is taken over, with a warning.

    Saving costs ~50 ms for a tiny MLP, ~0.35 s for a 10.5M-parameter MLP
    with Adam (126 MB), most of it fsync.
    """

    name = "checkpoint"
    changes_training = False

    def __init__(self, every_steps=None, every_epoch=True, keep_last=_DEFAULT, dir=None,
                 on_exception=False, signals=DEFAULT_SIGNALS, signal_check_every=10,
                 trust_pickles=(), monitor=None, mode="min", save_top_k=1, asynchronous=False):
        if keep_last is _DEFAULT:
            keep_last = 1 if monitor is not None else 3
        if monitor is not None and not (isinstance(monitor, str) and monitor):
            raise ValueError(f"Checkpoint: monitor must be a metric name, got {monitor!r}")
        if mode not in ("min", "max"):
            raise ValueError(f"Checkpoint: mode must be 'min' or 'max', got {mode!r}")
        for label, value in (("every_steps", every_steps), ("keep_last", keep_last),
                             ("save_top_k", save_top_k)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"Checkpoint: {label} must be a positive int or None, got {value!r}")
        if not isinstance(signal_check_every, int) or signal_check_every < 1:
            raise ValueError(f"Checkpoint: signal_check_every must be a positive int, got {signal_check_every!r}")
        if not isinstance(asynchronous, bool):
            raise ValueError(f"Checkpoint: asynchronous must be True or False, got {asynchronous!r}")
        self.asynchronous = asynchronous
        self.every_steps = every_steps
        self.every_epoch = bool(every_epoch)
        self.keep_last = keep_last
        self.dir = Path(dir) if dir is not None else None
        self.on_exception_save = bool(on_exception)
        self.signal_check_every = signal_check_every
        #: records the stop signal; ``watcher.received`` is this process's flag
        self.watcher = SignalWatcher(signals) if signals else None
        if isinstance(trust_pickles, str):
            trust_pickles = (trust_pickles,)
        #: ``custom_checkpoint_<i>.pkl`` files that resuming may unpickle (see
        #: :func:`hookloop.checkpointing.load`); by name only
        self.trust_pickles = tuple(trust_pickles)
        self.monitor = monitor
        self.mode = mode
        self.save_top_k = save_top_k
        #: ``{"path": Path, "value": float}`` of the best checkpoint by
        #: ``monitor`` (None before one is saved), read from the manifests at
        #: every fit start and updated at every save
        self.best: dict | None = None
        self._epoch_ending = False  # between on_train_epoch_end and on_epoch_end
        self._run_dir = None  # the run folder chosen at the first fit (default dir)
        #: the directory of the last checkpoint this plugin wrote, and why
        #: (``"every_steps"``, ``"epoch_end"``, ``"monitor"``, ``"fit_end"``,
        #: ``"preempted"``, ``"requested"`` ...: the manifest's ``reason``)
        self.last_saved: Path | None = None
        self.last_reason: str | None = None
        #: the checkpoint an asynchronous save is writing (None: none in flight)
        self.saving: Path | None = None
        self._stop = None
        self._stop_saved = None  # saved for the agreed stop (several Checkpoint plugins)
        self._fit_ended = False
        self._pending = None  # a signal that came during the fit's end
        self._saved_position = None
        self._ready = False  # on_fit_start checked the directory
        self._lock = None  # the run lock of the directory while a fit runs (main process)

    def directory(self, loop) -> Path:
        """The checkpoint root for ``loop``: ``dir``, else this run's folder;
        before the first fit, the newest run folder (what ``"latest"``
        resumes)."""
        if self.dir is not None:
            return self.dir
        if self._run_dir is not None:
            return self._run_dir
        base = checkpointing.default_directory(loop.accelerator)
        return checkpointing.newest_run(base) or base / "version_0"

    def best_checkpoint(self, loop, mine: bool = True):
        """``(value, path)`` of the best checkpoint by ``monitor`` in
        :meth:`directory` (this run's, unless ``mine`` is False), or None."""
        if self.monitor is None:
            return None
        found = checkpointing.best_checkpoints(loop, self.directory(loop), self.monitor, self.mode, 1,
                                               mine=mine)
        return found[0] if found else None

    def _choose_run_dir(self, loop):
        """Default directory: the resumed checkpoint's run folder, else a new
        ``version_<N>``, created by the main process for every process (with
        ``mkdir``: two runs starting together get two folders)."""
        base = checkpointing.default_directory(loop.accelerator)
        resumed = loop.resumed_from
        if resumed is not None and checkpointing.is_run_dir(base, resumed.parent):
            self._run_dir = resumed.parent
            return
        name = error = None
        if loop.accelerator.is_main_process:
            try:
                name = layout.claim_run_folder(base).name
            except checkpointing.CheckpointError as exc:
                error = str(exc)
        if loop.accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            name, error = broadcast_object_list([name, error])
        if error is not None:
            raise checkpointing.CheckpointError(error)
        self._run_dir = base / name

    # -- hooks -----------------------------------------------------------------

    @hookimpl
    def on_loop_start(self, loop):
        # from Loop(...) on, a signal ends the process with status 75: outside a
        # fit at once (the run's state is its last checkpoint), inside one at
        # the next safe point, after saving
        if self.watcher is not None and self.watcher.install():
            self.watcher.immediate = self._outside_fit(loop)

    @hookimpl
    def on_loop_end(self, loop):
        try:
            wait(loop)  # loop.close(): a save in flight (one outside a fit) is published first
        finally:
            self._uninstall()
        if self.watcher is not None:
            self.watcher.immediate = None

    @hookimpl
    def on_fit_start(self, loop):
        if self.dir is None and self._run_dir is None:
            self._choose_run_dir(loop)
        root = self.directory(loop)
        with every_rank(loop.accelerator):  # every rank fails, none waits
            if loop.accelerator.is_main_process:
                checkpointing.check_writable(root)
                # this run holds the root while it trains (a live one's is refused)
                self._lock = lock.acquire(root, checkpointing.run_identity(loop).id, owner=self)
                checkpointing.clean(root)  # with the lock: every other temporary is a dead run's
                (root / PREEMPTED_MARKER).unlink(missing_ok=True)  # resumed: that preemption is over
                _check_foreign(loop, root)
                _warn_newer(loop, root)
                if loop.resumed_from is not None and self.keep_last:
                    # a run killed after its last save, before it rotated
                    rotate(loop, root, self.keep_last, self._best_names(loop, root))
        self._candidate = self._requested = None
        self._stop = self._stop_saved = self._pending = None
        self._fit_ended = False
        if self._saved_position is None and loop.resumed_from is not None:
            self._saved_position = loop.state.state_dict()  # where the resumed checkpoint is
        if self.watcher is not None:
            self.watcher.install()
            self.watcher.start_fit()  # during the fit: at the next safe point, after saving
        self._epoch_ending = False
        self._update_best(loop)
        self._ready = True

    @hookimpl
    def on_train_epoch_end(self):
        self._epoch_ending = True  # the evaluation that follows is the epoch's

    @hookimpl(trylast=True)  # after the plugins that add metrics
    def on_eval_end(self, loop, metrics):
        if self.monitor is None:
            return
        if loop.state.stage == "sanity":  # fails in seconds, not after an epoch
            _check_monitor("Checkpoint", self.monitor, metrics)
            return
        if not self._ready or loop.state.stage != "eval" or self._epoch_ending:
            return  # (the epoch's evaluation: its metrics reach on_epoch_end)
        _check_monitor("Checkpoint", self.monitor, metrics, training=False)
        # saved with the value at this update's safe point, once the
        # evaluation has put the random states back
        self._candidate = float(metrics[self.monitor])

    @hookimpl(trylast=True)
    def on_epoch_end(self, loop, metrics):
        self._epoch_ending = False
        if self.monitor is not None:
            if self.monitor not in metrics:
                raise KeyError(
                    f"Checkpoint monitors {self.monitor!r}, but the epoch's metrics are "
                    f"{sorted(metrics) or 'empty (is eval_data set?)'}; pass monitor=... with one "
                    "of them (a training value: log it with loop.log(..., on_epoch=True))"
                )
            self._candidate = float(metrics[self.monitor])  # saved at the epoch's safe point

    @hookimpl(trylast=True)  # after the other plugins' work at the safe point, which it saves
    def on_safe_point(self, loop, epoch_end, fit_end):
        if self._lock is not None:
            self._lock.refresh()  # the heartbeat: at most every 30 s, else one clock read
        if self.saving is not None:
            poll(loop)  # a background save that finished: published, or its error raised here
        acc = loop.accelerator
        state = loop.state
        if self.watcher is not None and self._stop is None:
            self._stop = self.watcher.shared_stop  # another Checkpoint plugin agreed already: free
            if self._stop is None and (epoch_end or acc.num_processes == 1
                                       or state.global_step % self.signal_check_every == 0):
                self._stop = self.watcher.agreed(acc)
        candidate, requested = self._candidate, self._requested
        self._candidate = self._requested = None
        step_due = bool(self.every_steps) and state.global_step % self.every_steps == 0
        if step_due and not epoch_end and self.every_epoch and state.epoch_end_reason is not None:
            step_due = False  # the epoch's last update: its end follows, and is saved
        if self._stop is not None:
            reason = "preempted"
        elif requested is not None:
            reason = requested
        elif epoch_end and self.every_epoch:
            # an epoch ended early (a stop, max_steps) is saved at its mid-epoch position
            reason = "epoch_end" if not state.step_in_epoch else "fit_end"
        elif step_due:
            reason = "every_steps"
        elif candidate is not None:
            reason = "monitor"
        elif fit_end:
            reason = "fit_end"  # every fit ends with a checkpoint of its last position
        else:
            return
        path = self._save(loop, reason, monitor=candidate)
        if self._stop is not None:
            wait(loop)  # (a save of this position in flight: the stop's checkpoint)
            self._preempted(loop, self.last_saved or path)

    @hookimpl(trylast=True)  # after the other plugins' end-of-fit work
    def on_fit_end(self, loop):
        try:
            wait(loop)  # the fit's last checkpoint is on disk when fit returns
            # every rank takes the same decision (one all-reduce with several processes)
            self._pending = self.watcher.agreed(loop.accelerator) if self.watcher is not None else None
        finally:
            self._after_fit(loop)
            self._fit_ended = True
        # A signal that came during the fit's last safe point (its final save):
        # that save is the stop's checkpoint. End as a preemption does (status
        # 75), once every Checkpoint plugin has saved.
        peers = checkpointing.checkpoint_plugins(loop)
        if all(p._fit_ended for p in peers):
            pending = next((p._pending for p in peers if p._pending is not None), None)
            if pending is not None:
                self._stop = pending
                self._raise_preempted(loop, self.last_saved)

    @hookimpl(wrapper=True)  # around the others: the handlers go back even if one of them raises
    def on_exception(self, loop, exception):
        try:
            self._wait_quietly(loop)
            if (self.on_exception_save and self._ready and isinstance(exception, Exception)
                    and not _poisoned(exception)):
                self._emergency(loop, exception)
            return (yield)
        finally:
            self._after_fit(loop)  # after the emergency checkpoint; Preempted comes here too

    # -- work --------------------------------------------------------------------

    def save(self, loop, reason: str = "requested", epoch_end: bool = False) -> Path | None:
        """Save the run now, as this plugin's own saves are made (its
        directory, rotation and best-k ranking; not again at the same
        position when the fit ends), and return the checkpoint's directory.
        Every process must call it.

        At a safe point (``on_safe_point``, or outside ``fit``) it saves at
        once. Called from any other hook during a fit it returns None and the
        checkpoint is written at the next safe point (after this update and
        its evaluations; after the epoch's end when the epoch ends here),
        where a resume continues exactly; :attr:`last_saved` names it then.
        ``epoch_end`` is accepted for 0.2 code and not needed: a save asked
        for in ``on_epoch_end`` is taken at the epoch's safe point, whose
        position is already the next epoch's start."""
        if loop.at_safe_point:
            return self._save(loop, reason)
        self.request(reason)
        return None

    def wait(self, loop) -> Path | None:
        """Wait for the checkpoint an asynchronous save is writing (every
        process); returns it (None: none in flight). Raises the
        :class:`~hookloop.checkpointing.CheckpointError` of a save that failed."""
        wait(loop)
        return self.last_saved if self.saving is None else None

    def request(self, reason: str = "requested") -> None:
        """Save at the next safe point, whatever the schedule (during
        ``on_safe_point``, before this plugin's turn: at this one)."""
        self._requested = reason

    def _save(self, loop, reason, monitor=None) -> Path | None:
        position = loop.state.state_dict()
        epoch_end = position["step_in_epoch"] == 0
        if position == self._saved_position and monitor is None:
            return self.saving or self.last_saved or loop.resumed_from  # saved here already, or resumed from
        finite = loop.plugins.get("finite")
        if finite is not None and callable(getattr(finite, "check", None)):
            finite.check(loop)  # never publish a checkpoint of a run whose loss went NaN
        root = self.directory(loop)
        name = checkpointing.checkpoint_name(position["global_step"], epoch_end)
        record = None
        keep: set[str] | tuple[()] = ()
        if self.monitor is not None:
            if monitor is not None:
                record = {"key": self.monitor, "value": monitor, "mode": self.mode}
            extra = (monitor, root / name) if monitor is not None and math.isfinite(monitor) else None
            keep = self._best_names(loop, root, extra)
        self.last_reason = reason

        def published(path):
            self.last_saved, self.saving = path, None
            if record is not None:
                self._update_best(loop)

        # a preemption's checkpoint must be on disk before the process ends
        background = self.asynchronous and reason != "preempted"
        path = checkpointing.save(loop, root, reason=reason, name=name, keep_last=self.keep_last,
                                  monitor=record, keep=keep, asynchronous=background,
                                  on_published=published)
        self._saved_position = position
        if self.last_saved != path:
            self.saving = path  # (written in the background; published() when it lands)
        return path

    def _best_names(self, loop, root, extra=None) -> set:
        """The checkpoints rotation keeps for ``save_top_k`` (``extra``: one
        about to be written, ``(value, path)``)."""
        if self.monitor is None:
            return set()
        return {p.name for _, p in checkpointing.best_checkpoints(
            loop, root, self.monitor, self.mode, self.save_top_k, extra)}

    def _update_best(self, loop):
        found = self.best_checkpoint(loop)
        self.best = None if found is None else {"path": found[1], "value": found[0]}

    def _preempted(self, loop, path):
        """Saved for the stop: the last Checkpoint plugin (in call order) to
        save for it ends the run; the ones before it return, so that every
        Checkpoint plugin saves."""
        self._stop_saved = path
        peers = [p for p in checkpointing.checkpoint_plugins(loop) if p.watcher is not None]
        if all(p._stop_saved is not None for p in peers):
            self._raise_preempted(loop, path)

    def _raise_preempted(self, loop, path):
        step = loop.state.global_step
        self._mark_preempted(loop, self._stop, path)
        loop.print(
            f"hookloop: {signal_name(self._stop)} received: saved {path} after step {step}; "
            f"exiting with status {Preempted(self._stop, step).code}",
            file=sys.stderr,
        )
        raise Preempted(self._stop, step, path)

    def _wait_quietly(self, loop):
        """An exception ends the fit: the save in flight is published first;
        its own failure is only a warning (the exception matters more)."""
        try:
            wait(loop)
        except Exception as exc:  # noqa: BLE001
            warnings.warn(f"Checkpoint: {exc}", RuntimeWarning, stacklevel=3)
            self.saving = None

    def _emergency(self, loop, exception):
        if loop.accelerator.num_processes > 1:
            warnings.warn(
                "Checkpoint(on_exception=True): no emergency checkpoint with several processes "
                "(the other ranks cannot join a save from an error on one)",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        name = "emergency-" + checkpointing.checkpoint_name(loop.state.global_step)
        try:
            path = checkpointing.save(loop, self.directory(loop), reason="exception", name=name,
                                      update_latest=False)
        except Exception as exc:  # noqa: BLE001 - the original error matters more
            warnings.warn(f"Checkpoint: emergency checkpoint failed: {exc}", RuntimeWarning, stacklevel=2)
            return
        loop.print(f"hookloop: {type(exception).__name__} during training: emergency checkpoint "
                   f"{path} (may be mid-step: resume from it explicitly)", file=sys.stderr)

    def _after_fit(self, loop):
        """A fit ended, by any path: the lock goes; a signal from now on ends
        the process at once (status 75), until the loop is closed."""
        self._ready = False
        self._release()
        if self.watcher is not None and self.watcher.installed:
            self.watcher.immediate = self._outside_fit(loop)

    def _outside_fit(self, loop):
        """What a signal does outside a fit: nothing new to save (the run's
        state is its last checkpoint), ``Preempted`` at once, status 75."""

        def preempted(signum):
            self._stop = signum
            step = loop.state.global_step
            path = self.last_saved
            saved = f"its last checkpoint is {path}" if path is not None else "nothing was saved"
            loop.print(f"hookloop: {signal_name(signum)} received outside fit (nothing new to save; "
                       f"{saved}); exiting with status {Preempted(signum, step).code}", file=sys.stderr)
            self._mark_preempted(loop, signum, path)
            raise Preempted(signum, step, path)

        return preempted

    def _mark_preempted(self, loop, signum, path):
        """``<root>/PREEMPTED``: what a requeue wrapper under a launcher (which
        reports its own status, 1) looks for; removed when a fit starts there."""
        if not loop.accelerator.is_main_process:
            return
        import json
        import time

        try:
            root = self.directory(loop)
            if root.is_dir():
                (root / PREEMPTED_MARKER).write_text(json.dumps({
                    "signal": signal_name(signum), "global_step": loop.state.global_step,
                    "checkpoint": str(path) if path is not None else None,
                    "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n")
        except OSError:
            pass  # a marker is a courtesy: the exit status still says 75

    def _uninstall(self):
        self._ready = False
        if self.watcher is not None:
            self.watcher.uninstall()

    def _release(self):
        held, self._lock = self._lock, None
        if held is not None:
            held.release(owner=self)


def _check_monitor(who: str, monitor: str, metrics, training: bool = True) -> None:
    """A monitored metric that the evaluation does not have: an error naming
    the metrics it has. ``training``: a name that starts with ``train`` is a
    value logged during training (``loop.log(..., on_epoch=True)``), known
    only at the epoch's end, and passes."""
    if monitor in metrics or (training and monitor.startswith("train")):
        return
    raise KeyError(
        f"{who} monitors {monitor!r}, but the evaluation's metrics are "
        f"{sorted(metrics) or 'empty'}; pass monitor=... with one of them (a value logged during "
        "training with loop.log(..., on_epoch=True) is known at the epoch's end: name it "
        "train_<something>)"
    )


def _check_foreign(loop, root):
    """Checkpoints in ``root`` that are not this run's (another run's, a
    copy, hookloop 0.1 ones not resumed from): a run starting from scratch,
    or resumed from another directory, would mix its checkpoints with them
    (replace them, and rotate them away): refuse. A run resumed from this
    directory leaves them alone, with a warning."""
    import os

    foreign = checkpointing.foreign_checkpoints(loop, root)
    if not foreign:
        return
    names = ", ".join(p.name for p in foreign[-3:])
    runs = ", ".join(sorted({checkpointing.describe_run(p) for p in foreign}))
    run = checkpointing.run_identity(loop)
    if run.resumed_root is None:
        raise checkpointing.CheckpointError(
            f"{str(root)!r} already holds checkpoints of a run ({names}) "
            "and this run starts from scratch: its checkpoints would replace them. Continue that "
            "run with resume_from='latest', or give Checkpoint(dir=...) another directory."
        )
    if run.resumed_root != os.path.realpath(root):
        raise checkpointing.CheckpointError(
            f"{str(root)!r} holds checkpoints that are not this run's ({names}; {runs}), and this "
            f"run resumed from {str(loop.resumed_from)!r}, in another directory: its checkpoints "
            "would be mixed with them, replace them and rotate them away. Resume from that "
            "directory's own checkpoints (resume_from='latest' with this dir), or give "
            "Checkpoint(dir=...) an empty directory."
        )
    warnings.warn(
        f"Checkpoint: {root} also holds {len(foreign)} checkpoint(s) that are not this run's "
        f"({names}; {runs}): they are left alone, never replaced or rotated away",
        RuntimeWarning,
        stacklevel=2,
    )


def _warn_newer(loop, root):
    """Resumed from an older checkpoint: the newer ones belong to a timeline
    this run abandons, and will be replaced or rotated away as it saves."""
    if loop.resumed_from is None or loop.resumed_from.parent.resolve() != root.resolve():
        return
    mine = sort_key(loop.resumed_from) if NAME_PATTERN.match(loop.resumed_from.name) else None
    newer = [p.name for p in checkpointing.list_checkpoints(root)
             if mine is not None and sort_key(p) > mine]
    if newer:
        warnings.warn(
            f"Checkpoint: resumed from {loop.resumed_from.name}, but {root} also holds newer "
            f"checkpoints ({', '.join(newer)}) of the run that went on from there: this run's "
            "checkpoints will replace them, and rotation may delete them",
            RuntimeWarning,
            stacklevel=2,
        )


def _poisoned(exception) -> bool:
    """A non-finite loss: the parameters are not worth saving."""
    from .finite import NonFiniteLoss

    seen = exception
    while seen is not None:
        if isinstance(seen, NonFiniteLoss):
            return True
        seen = seen.__cause__
    return False
