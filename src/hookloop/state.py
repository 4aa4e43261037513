"""The run state: everything a restart needs, in one declared place.

:class:`LoopState` (``loop.state``) is what plugins read (the position, this
fit's limits and requests, what the loop is doing) and, alongside, the rest
of what a resumed run must find again exactly as the interrupted one had it:
the run's identity, the random state its current epoch started from, the
epoch's ``loop.log(on_epoch=True)`` accumulators, the evaluation already done
at this update and the metrics the last epoch ended with. A checkpoint writes
all of it (:meth:`LoopState.run_dict` in the manifest, the per-process parts
in each process's rank file) together with each stateful plugin's
``state_dict()``; nothing else in the loop survives a restart, and nothing
outside this class needs to.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from .epoch_values import EpochValues

#: why an epoch ended (``loop.state.epoch_end_reason``): its data ran out
DATA = "data"
#: :meth:`Loop.end_epoch` ended it: over, as if its data had run out
END_EPOCH = "end_epoch"
#: :meth:`Loop.stop` ended it early: the next fit continues it
STOP = "stop"
#: ``fit(max_steps=N)`` was reached: the next fit continues it
MAX_STEPS = "max_steps"
EPOCH_END_REASONS = (DATA, END_EPOCH, STOP, MAX_STEPS)

#: the fields of the position: what 0.1 and 0.2 checkpoints hold as ``loop``
POSITION = ("epoch", "step_in_epoch", "global_step", "micro_step")


@dataclass
class RunIdentity:
    """Which run a loop continues. ``id`` is recorded in every checkpoint's
    manifest (``run_id``); a resumed run inherits the id of the checkpoint it
    resumed. ``resumed_root`` is the real path of that checkpoint's root
    (None: the run started from scratch); ``legacy``: it had no run id (a
    hookloop 0.1 checkpoint)."""

    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    resumed_root: str | None = None
    legacy: bool = False


@dataclass(eq=False)
class LoopState:
    """Where the run is, and what the current fit was asked to do.

    Two counters of training progress, as in Lightning and the Hugging Face
    Trainer: ``global_step`` counts optimizer *updates*, ``micro_step``
    counts trained *batches*. Without gradient accumulation they are equal;
    with ``gradient_accumulation_steps=k`` there is one update per k batches
    (and one for the last, partial group of an epoch).

    Plugins read every field; they change the requests only through
    :meth:`Loop.stop`, :meth:`Loop.skip_batch` and :meth:`Loop.end_epoch`.
    """

    # -- the position (checkpointed; ``state_dict()``) --------------------------

    #: the current epoch, counted from 0
    epoch: int = 0
    #: batches drawn from ``train_data`` in the current epoch (skipped ones
    #: included): the data position a resume continues from
    step_in_epoch: int = 0
    #: completed optimizer updates over the whole run (under gradient
    #: accumulation one per accumulation group; in the GAN strategy one batch
    #: is one update of each network). ``fit(max_steps=N)``,
    #: ``Checkpoint(every_steps=N)``, ``Logger(every=N)`` and
    #: ``fit(eval_every=N)`` count these. See ``hookspecs.py`` for its value
    #: inside each hook.
    global_step: int = 0
    #: trained batches (micro-batches) over the whole run, skipped ones
    #: excluded: what ``global_step`` counted in hookloop 0.1
    micro_step: int = 0

    # -- the rest of the run (checkpointed; ``run_dict()`` and the rank files) --

    #: the run's identity (its id is in every checkpoint it writes)
    run: RunIdentity = field(default_factory=RunIdentity, repr=False)
    #: the ``global_step`` of the last ``eval_every`` evaluation, and its
    #: metrics: an epoch that ends at that update is not evaluated twice
    evaluated_at: int | None = None
    evaluation: dict[str, Any] = field(default_factory=dict, repr=False)
    #: the metrics the last epoch ended with (what :meth:`Loop.fit` returns,
    #: also when asked to fit a run that is already finished)
    last_metrics: dict[str, Any] = field(default_factory=dict, repr=False)
    #: the current epoch ended early (a stop, ``max_steps``) and its end
    #: (``on_train_epoch_end`` ... ``on_epoch_end``) ran at this position: a
    #: continuation that finds no batch left does not end it a second time
    epoch_ended: bool = False
    #: why the run's last fit was stopped (:meth:`Loop.stop`) at this
    #: position, None if training went on since: a run resumed here is the
    #: stopped fit, which trains no further (a second ``fit`` continues)
    stopped: str | None = None
    #: per process: the random states the current epoch's data iterator
    #: started from (redrawn to continue the epoch in the same order)
    epoch_start: dict[str, Any] | None = field(default=None, repr=False)
    #: per process: ``loop.log(..., on_epoch=True)`` values of the epoch so far
    logged: EpochValues = field(default_factory=EpochValues, repr=False)

    # -- this fit (not checkpointed) --------------------------------------------

    #: epochs or steps the current ``fit`` was asked for (None: not limited)
    max_epochs: int | None = None
    max_steps: int | None = None
    #: set by :meth:`Loop.stop`: the loop ends the epoch at the next update
    #: boundary (evaluation and ``on_epoch_end`` still run)
    should_stop: bool = False
    stop_reason: str | None = None
    #: set by :meth:`Loop.skip_batch` in ``before_step``; reset every batch
    skip_batch: bool = False
    #: set by :meth:`Loop.end_epoch`: the epoch ends at the next update boundary
    end_epoch: bool = False
    #: from ``on_train_epoch_end`` to ``on_epoch_end``: True when the epoch is
    #: over (its data ran out, or :meth:`Loop.end_epoch`; the next epoch
    #: follows), False when a stop or ``max_steps`` ended it early (the next
    #: ``fit`` continues this epoch)
    epoch_complete: bool = False
    #: why the current epoch ends, one of :data:`EPOCH_END_REASONS`
    #: (``"data"``, ``"end_epoch"``, ``"stop"``, ``"max_steps"``), from
    #: ``on_train_epoch_end`` to the epoch's safe point, and already at the
    #: safe point of an update the loop knows to be the epoch's last
    #: (``"data"``); None otherwise
    epoch_end_reason: str | None = None
    #: what the loop is doing: ``"train"``, ``"eval"`` (an evaluation, at an
    #: epoch end, every ``eval_every`` updates or from :meth:`Loop.evaluate`),
    #: ``"sanity"`` (the sanity check: an evaluation of one batch before training),
    #: ``"predict"``, ``"find_lr"`` (the training steps of :meth:`Loop.find_lr`),
    #: or ``None`` outside ``fit`` / ``evaluate`` / ``predict`` / ``find_lr``
    stage: str | None = None
    #: during an evaluation a fit runs on its own schedule: ``"every"``
    #: (``fit(eval_every=N)``) or ``"epoch"`` (an epoch's end); None during
    #: the sanity check, a :meth:`Loop.evaluate` call, and outside evaluations
    scheduled_eval: str | None = None

    def state_dict(self) -> dict[str, Any]:
        """The position, as plain data (ints): a checkpoint's ``loop``."""
        return {key: getattr(self, key) for key in POSITION}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the position (a checkpoint's ``loop``). Unknown keys are
        an error: the checkpoint is not what this hookloop wrote."""
        for key, value in state.items():
            if key not in POSITION:
                raise KeyError(f"unknown LoopState field {key!r} in checkpoint")
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"LoopState field {key!r} must be a non-negative int, got {value!r}")
            setattr(self, key, value)
        if "micro_step" not in state:  # a hookloop 0.1 checkpoint: global_step counted batches
            self.micro_step = self.global_step

    def run_dict(self) -> dict[str, Any]:
        """The rest of the run that every process shares, as plain data (a
        checkpoint's ``run``); the per-process parts (``epoch_start``,
        ``logged``) go into each process's rank file."""
        return {
            "evaluated_at": self.evaluated_at,
            "evaluation": _plain(self.evaluation),
            "last_metrics": _plain(self.last_metrics),
            "epoch_ended": self.epoch_ended,
            "stopped": self.stopped,
        }

    def load_run_dict(self, run: dict[str, Any]) -> None:
        """Restore :meth:`run_dict` (absent from 0.1 and 0.2 checkpoints: the
        defaults)."""
        evaluated_at = run.get("evaluated_at")
        if evaluated_at is not None and (not isinstance(evaluated_at, int) or isinstance(evaluated_at, bool)):
            raise ValueError(f"run field 'evaluated_at' must be an int or null, got {evaluated_at!r}")
        for key in ("evaluation", "last_metrics"):
            if not isinstance(run.get(key, {}), dict):
                raise ValueError(f"run field {key!r} must be an object, got {run[key]!r}")
        self.evaluated_at = evaluated_at
        self.evaluation = _numbers(run.get("evaluation", {}))
        self.last_metrics = _numbers(run.get("last_metrics", {}))
        self.epoch_ended = bool(run.get("epoch_ended", False))
        stopped = run.get("stopped")
        if stopped is not None and not isinstance(stopped, str):
            raise ValueError(f"run field 'stopped' must be a string or null, got {stopped!r}")
        self.stopped = stopped

    def stop(self, reason: str | None) -> None:
        """End the fit at the next update boundary (:meth:`Loop.stop`)."""
        self.should_stop = True
        self.stop_reason = reason

    def new_epoch(self) -> None:
        """The current epoch is over: the next one starts at its first batch."""
        self.epoch += 1
        self.step_in_epoch = 0
        self.epoch_ended = False
        self.epoch_start = None
        self.logged.clear()

    def start_fit(self, epochs: int | None, max_steps: int | None) -> None:
        """A fit begins: its limits, no request pending."""
        self.max_epochs, self.max_steps = epochs, max_steps
        self.should_stop, self.stop_reason, self.skip_batch = False, None, False
        self.end_epoch = False
        self.epoch_complete, self.epoch_end_reason = False, None

    @property
    def finished(self) -> bool:
        """Whether the current fit's limits are reached (or a stop was asked)."""
        return (
            self.should_stop
            or (self.max_steps is not None and self.global_step >= self.max_steps)
            or (self.max_epochs is not None and self.epoch >= self.max_epochs)
        )


def _plain(metrics: dict[str, Any]) -> dict[str, Any]:
    """Metrics as numbers (a 0-d tensor read as one); anything else is left out."""
    out = {}
    for key, value in metrics.items():
        if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
            value = value.item()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[str(key)] = value
    return out


def _numbers(metrics: dict[str, Any]) -> dict[str, Any]:
    """Metrics as written by :meth:`LoopState.run_dict`: str -> number."""
    out = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"metric {key!r} must be a number, got {value!r}")
        out[key] = value
    return out
