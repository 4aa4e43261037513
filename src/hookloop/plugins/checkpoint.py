"""Checkpoints every N updates and/or every epoch: the schedule (when, where,
how many, which is best). :mod:`hookloop.checkpointing` writes, verifies and
reads; it knows this plugin only as a
:class:`~hookloop.checkpointing.CheckpointPolicy`. Stopping on a signal is the
``preemption`` plugin's (:mod:`hookloop.plugins.preemption`), which this one
brings along."""

from __future__ import annotations

import sys
import warnings
import weakref
from pathlib import Path

from .. import checkpointing
from ..checkpointing import saving as runs
from ..checkpointing import store, writer
from ..checkpointing.collective import every_rank
from ..checkpointing.saving import prepare_asynchronous
from ..checkpointing.writer import poll, wait
from ..markers import hookimpl
from ..preemption import DEFAULT_SIGNALS

_DEFAULT = object()  # keep_last not given: 3, or 1 with monitor


class Checkpoint(checkpointing.CheckpointPolicy):
    """Save the whole run (see :mod:`hookloop.checkpointing` for what a
    checkpoint holds), atomically, keeping the newest ``keep_last``; resume
    with ``Loop(..., resume_from="latest")``.

    :param every_steps: save after every N-th optimizer update
        (``global_step``; None: never mid-epoch). Under gradient accumulation
        a save waits for the end of the accumulation group.
    :param every_epoch: save at the end of every epoch, after its evaluation
        and the other plugins' ``on_epoch_end``.
    :param keep_last: how many of this run's newest checkpoints to keep
        (None: all; default 3, or 1 with ``monitor``); another run's are never
        deleted, nor the newest finite one, nor the ``save_top_k`` best.
    :param dir: the checkpoint root. Default: a run folder of its own,
        ``<accelerator.project_dir or .>/checkpoints/version_<N>``: a run
        from scratch takes the next N (as Lightning's ``version_N``), or the
        newest folder if all it holds is what a dead run left (a stale lock,
        an unfinished save: the same command continues it); a resumed run
        continues in its checkpoint's folder, and ``resume_from="latest"``
        finds the newest folder's latest checkpoint. A ``dir`` given
        explicitly is the root itself; a run from scratch there is refused if
        another run's checkpoints are in it.
    :param monitor: keep the best checkpoints by this metric (a key of an
        evaluation's metrics: the epoch-end one, or every ``eval_every``
        updates; ``train_loss`` logged with ``loop.log(on_epoch=True)``
        works too). Every evaluation that yields it saves a checkpoint
        recording the value; rotation keeps the ``save_top_k`` best and the
        ``keep_last`` newest. :attr:`best` and ``loop.load_checkpoint("best")``
        find the best one, also after a resume.
    :param mode: ``"min"`` (a loss) or ``"max"`` (an accuracy).
    :param save_top_k: how many best checkpoints to keep (with ``monitor``).
    :param on_exception: also save an emergency checkpoint
        (``emergency-step-N``) when training raises, which ``latest`` never
        names (it may be mid-step); one process only.
    :param signals: the signals on which the run saves here at the next safe
        point and ends with status 75 (:mod:`hookloop.plugins.preemption`;
        None or ``()``: this plugin does not save for a signal).
    :param signal_check_every: with several processes, agree on a stop at the
        safe points of every N-th update and at every epoch end.
    :param trust_pickles: names of ``custom_checkpoint_<i>.pkl`` files (the
        state of objects given to ``accelerator.register_for_checkpointing``)
        that resuming may unpickle although they are not plain data.
    :param asynchronous: copy the state to host memory at the safe point and
        write the checkpoint in the background while training goes on (at
        most one in flight; ``latest`` and :attr:`last_saved` name the
        previous one until it is published, :attr:`saving` the one being
        written). The fit's end, ``close()``, an exception and a preemption
        wait for it; a failed one raises a ``CheckpointError`` naming it at
        the next safe point (several processes: the next save or the fit's end).

    Checkpoints are written only at the loop's safe points (``on_safe_point``,
    ``trylast``), where a resume continues exactly what the uninterrupted run
    does next; every fit ends with a checkpoint of its final position. While a
    fit runs, its main process holds the directory (``<dir>/hookloop.lock``,
    :mod:`hookloop.checkpointing.lock`): another process's ``resume_from`` of
    it, or a fit into it, is refused while that process lives.
    """

    name = "checkpoint"
    changes_training = False
    #: the built-in plugins this one works with (registered with it, as pytest's ``pytest_plugins``)
    hookloop_plugins = ("preemption",)

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
                             ("save_top_k", save_top_k), ("signal_check_every", signal_check_every)):
            if value is None and label != "signal_check_every":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                allowed = "a positive int" + (" or None" if label != "signal_check_every" else "")
                raise ValueError(f"Checkpoint: {label} must be {allowed}, got {value!r}")
        if not isinstance(asynchronous, bool):
            raise ValueError(f"Checkpoint: asynchronous must be True or False, got {asynchronous!r}")
        self.every_steps, self.every_epoch, self.keep_last = every_steps, bool(every_epoch), keep_last
        self.dir = Path(dir) if dir is not None else None
        self.on_exception_save, self.asynchronous = bool(on_exception), asynchronous
        self.signals, self.signal_check_every = tuple(signals or ()), signal_check_every
        self.trust_pickles = (trust_pickles,) if isinstance(trust_pickles, str) else tuple(trust_pickles)
        self.monitor, self.mode, self.save_top_k = monitor, mode, save_top_k
        #: ``{"path": Path, "value": float}`` of the best checkpoint by ``monitor`` (None before one)
        self.best: dict | None = None
        #: the last checkpoint this plugin wrote, and why (``"every_steps"``, ``"epoch_end"``,
        #: ``"monitor"``, ``"fit_end"``, ``"preempted"``, ``"requested"`` ...: its ``reason``)
        self.last_saved: Path | None = None
        self.last_reason: str | None = None
        self._run_dir = None  # the run folder chosen at the first fit (default dir)
        self._resumed = None  # (path, manifest) of the checkpoint the loop resumed from
        self._epoch_ending = False  # between on_train_epoch_end and on_epoch_end
        self._candidate = self._requested = self._saved_position = None
        self._ready = False  # on_fit_start set the directory up
        self._prepared = False  # the first asynchronous save's host buffers are being allocated
        self._lock = None  # the run lock of the directory while a fit runs (main process)
        self._loop = None  # the loop it saves (whose save in flight :attr:`saving` names)

    def directory(self, loop) -> Path:
        """The checkpoint root: ``dir``, else this run's folder; before the
        first fit, the newest run folder (what ``"latest"`` resumes)."""
        return self.dir or self._run_dir or self.roots(loop)[0]

    def roots(self, loop) -> list[Path]:
        if self.dir is not None or self._run_dir is not None:
            return [self.dir or self._run_dir]
        return runs.run_roots(store.default_directory(loop.accelerator))

    def best_checkpoint(self, loop, mine: bool = True):
        """``(value, path)`` of the best checkpoint by ``monitor`` in
        :meth:`directory` (this run's, unless ``mine`` is False), or None."""
        if self.monitor is None:
            return None
        found = runs.Scan(self.directory(loop)).best(loop.state.run, self.monitor, self.mode, 1, mine=mine)
        return found[0] if found else None

    # -- hooks -----------------------------------------------------------------

    @hookimpl
    def after_load_checkpoint(self, checkpoint, manifest):
        self._resumed = (checkpoint, manifest) if manifest is not None else None

    @hookimpl
    def on_loop_start(self, loop):
        if self.asynchronous and loop.accelerator.is_main_process:
            writer.start_early(loop)  # (a new interpreter's ~2 s of imports overlap the loop's own)

    @hookimpl
    def on_loop_end(self, loop):
        try:
            wait(loop)  # loop.close(): a save in flight (one outside a fit) is published first
        finally:
            writer.close(loop)

    @hookimpl
    def on_fit_start(self, loop):
        acc = loop.accelerator
        resumed, self._resumed = self._resumed, None  # (the rotation it allows: once)
        if self.dir is None and self._run_dir is None:
            self._choose_run_dir(loop)
        root, scan = self.directory(loop), None
        with every_rank(acc):  # every rank fails, none waits
            if acc.is_main_process:
                best = (self.monitor, self.mode, self.save_top_k) if self.monitor else None
                self._lock, scan = runs.open_root(loop, root, self, resumed, self.keep_last, best)
        self._candidate = self._requested = None
        if self._saved_position is None and loop.resumed_from is not None:
            self._saved_position = loop.state.state_dict()  # where the resumed checkpoint is
        self._epoch_ending = False
        self._update_best(loop, scan)
        if self.asynchronous and acc.is_main_process:
            writer.writer_of(loop, ready=True)  # (forked now, or again if it died since: ready before any save)
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
        self._candidate = float(metrics[self.monitor])  # saved at this update's safe point

    @hookimpl(trylast=True)
    def on_epoch_end(self, loop, metrics):
        self._epoch_ending = False
        if self.monitor is not None:
            if self.monitor not in metrics:
                raise KeyError(
                    f"Checkpoint monitors {self.monitor!r}, but the epoch's metrics are "
                    f"{sorted(metrics) or 'empty (is eval_data set?)'}; pass monitor=... with one "
                    "of them (a training value: log it with loop.log(..., on_epoch=True))")
            self._candidate = float(metrics[self.monitor])  # saved at the epoch's safe point

    @hookimpl(trylast=True)  # after the other plugins' work at the safe point, which it saves
    def on_safe_point(self, loop, epoch_end, fit_end):
        if self._lock is not None:
            self._lock.refresh()  # the heartbeat: at most every 30 s, else one clock read
        if writer.pending(loop) is not None:
            poll(loop)  # a background save that finished: published, or its error raised here
        state = loop.state
        candidate, requested = self._candidate, self._requested
        self._candidate = self._requested = None
        step_due = bool(self.every_steps) and state.global_step % self.every_steps == 0
        if step_due and not epoch_end and self.every_epoch and state.epoch_end_reason is not None:
            step_due = False  # the epoch's last update: its end follows, and is saved
        if requested is not None:
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
            if self.asynchronous and not self._prepared:  # (once: the state exists after an update)
                self._prepared = True
                prepare_asynchronous(loop)  # the first save's host buffers, while training goes on
            return
        self._save(loop, reason, monitor=candidate)

    @hookimpl(trylast=True)  # after the other plugins' end-of-fit work
    def on_fit_end(self, loop):
        try:
            wait(loop)  # the fit's last checkpoint is on disk when fit returns
        finally:
            self._release()

    @hookimpl(wrapper=True)  # around the others: the lock goes even if one of them raises
    def on_exception(self, loop, exception):
        try:
            try:
                wait(loop)  # the save in flight is published first; its failure only warns
            except Exception as exc:  # noqa: BLE001 - the exception that ends the fit matters more
                warnings.warn(f"Checkpoint: {exc}", RuntimeWarning, stacklevel=2)
            if (self.on_exception_save and self._ready and isinstance(exception, Exception)
                    and not _poisoned(exception)):
                self._emergency(loop, exception)
            return (yield)
        finally:
            self._release()

    # -- work --------------------------------------------------------------------

    @property
    def saving(self) -> Path | None:
        """Where the asynchronous save in flight lands (None: none in flight)."""
        loop = self._loop() if self._loop is not None else None
        pending = writer.pending(loop) if loop is not None else None
        return pending.landing if pending is not None else None

    def save(self, loop, reason: str = "requested") -> Path | None:
        """Save the run now, as this plugin's own saves are made, and return
        the checkpoint's directory (every process must call it). At a safe
        point (``on_safe_point``, or outside ``fit``) it saves at once; from
        any other hook during a fit it returns None and the checkpoint is
        written at the next safe point (:attr:`last_saved` names it then)."""
        if loop.at_safe_point:
            return self._save(loop, reason)
        self.request(reason)
        return None

    def wait(self, loop) -> Path | None:
        """Wait for the checkpoint an asynchronous save is writing (every
        process); returns it (None: none in flight)."""
        wait(loop)
        return self.last_saved if self.saving is None else None

    def request(self, reason: str = "requested") -> None:
        """Save at the next safe point, whatever the schedule (during
        ``on_safe_point``, before this plugin's turn: at this one);
        ``"preempted"``: synchronously, and before any other request."""
        if self._requested != "preempted":
            self._requested = reason

    def _save(self, loop, reason, monitor=None) -> Path | None:
        position = loop.state.state_dict()
        if position == self._saved_position and monitor is None:
            return self.saving or self.last_saved or loop.resumed_from  # saved here already, or resumed from
        wait(loop)  # the save in flight first: what it publishes counts for rotation and best-k
        root = self.directory(loop)
        name = store.checkpoint_name(position["global_step"], position["step_in_epoch"] == 0)
        loop.hook.before_save_checkpoint(loop=loop, checkpoint=root / name, reason=reason)
        record = None if monitor is None else {"key": self.monitor, "value": monitor, "mode": self.mode}
        self.last_reason, self._loop = reason, weakref.ref(loop)

        def published(saved):  # (the one scan of the save found the best)
            self.last_saved = saved.path
            if self.monitor is not None:
                self.best = None if saved.best is None else {"path": saved.best[1], "value": saved.best[0]}
            loop.hook.after_save_checkpoint(loop=loop, checkpoint=saved.path, reason=reason)

        path = checkpointing.save(loop, root, reason=reason, name=name, keep_last=self.keep_last, monitor=record,
                                  best=(self.monitor, self.mode, self.save_top_k) if self.monitor else None,
                                  on_published=published, asynchronous=self.asynchronous and reason != "preempted")
        self._saved_position = position
        return path

    def _choose_run_dir(self, loop):
        """Default directory: the resumed checkpoint's run folder, else the
        newest one a dead run left (taken over) or a new ``version_<N>``;
        chosen by the main process for every process."""
        base = store.default_directory(loop.accelerator)
        resumed = loop.resumed_from
        if resumed is not None and store.is_run_dir(base, resumed.parent):
            self._run_dir = resumed.parent
            return
        name = error = None
        if loop.accelerator.is_main_process:
            try:
                folder, self._lock = runs.take_run_folder(base, self, loop.state.run.id)
                name = folder.name
            except checkpointing.CheckpointError as exc:
                error = str(exc)
        if loop.accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            name, error = broadcast_object_list([name, error])
        if error is not None:
            raise checkpointing.CheckpointError(error)
        self._run_dir = base / name

    def _update_best(self, loop, scan=None):
        if self.monitor is None:
            return
        found = (scan or runs.Scan(self.directory(loop))).best(loop.state.run, self.monitor, self.mode, 1)
        self.best = {"path": found[0][1], "value": found[0][0]} if found else None

    def _emergency(self, loop, exception):
        if loop.accelerator.num_processes > 1:
            warnings.warn("Checkpoint(on_exception=True): no emergency checkpoint with several processes "
                          "(the other ranks cannot join a save from an error on one)", RuntimeWarning,
                          stacklevel=3)
            return
        name = "emergency-" + store.checkpoint_name(loop.state.global_step)
        try:
            path = checkpointing.save(loop, self.directory(loop), reason="exception", name=name,
                                      update_latest=False)
        except Exception as exc:  # noqa: BLE001 - the original error matters more
            warnings.warn(f"Checkpoint: emergency checkpoint failed: {exc}", RuntimeWarning, stacklevel=3)
            return
        loop.print(f"hookloop: {type(exception).__name__} during training: emergency checkpoint "
                   f"{path} (may be mid-step: resume from it explicitly)", file=sys.stderr)

    def _release(self):
        """A fit ended, by any path: the lock goes."""
        self._ready = False
        held, self._lock = self._lock, None
        if held is not None:
            held.release(owner=self)


def _check_monitor(who: str, monitor: str, metrics, training: bool = True) -> None:
    """A monitored metric that the evaluation does not have: an error naming
    the metrics it has. ``training``: a name that starts with ``train`` is a
    value logged during training, known only at the epoch's end, and passes."""
    if monitor in metrics or (training and monitor.startswith("train")):
        return
    raise KeyError(
        f"{who} monitors {monitor!r}, but the evaluation's metrics are "
        f"{sorted(metrics) or 'empty'}; pass monitor=... with one of them (a value logged during "
        "training with loop.log(..., on_epoch=True) is known at the epoch's end: name it "
        "train_<something>)")


def _poisoned(exception) -> bool:
    """A non-finite loss: the parameters are not worth saving."""
    from .finite import NonFiniteLoss

    seen = exception
    while seen is not None:
        if isinstance(seen, NonFiniteLoss):
            return True
        seen = seen.__cause__
    return False
