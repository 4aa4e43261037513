"""Stop training after a wall-clock duration, as Lightning's ``Timer`` does."""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ..markers import hookimpl

if TYPE_CHECKING:  # names for the annotations only
    from ..protocols import LoopLike

#: the clock (a test may replace it)
_now = time.monotonic

#: the stages whose time is kept
STAGES = ("train", "eval")


class Timer:
    """Stop training (:meth:`Loop.stop <hookloop.Loop.stop>`) once it has
    run for ``duration``, and tell how long it ran.

    ``Timer(duration="00:12:00:00")`` (``DD:HH:MM:SS``), a
    :class:`datetime.timedelta`, or a dict of ``timedelta`` arguments
    (``{"hours": 12}``); ``None`` only measures. ``interval="step"`` checks
    after optimizer updates, ``"epoch"`` at the end of every epoch's
    training (``on_train_epoch_end``); a run whose checkpoint already used
    up the time stops at once (checked in ``on_fit_start``). The stop ends
    the epoch as any stop does: its evaluation and ``on_epoch_end`` still
    run.

    The time counted is the wall time inside :meth:`Loop.fit
    <hookloop.Loop.fit>` (evaluations during the fit included), added up
    over the fits of one run and over resumes: :meth:`state_dict` holds it,
    so a checkpoint plugin saves it and a resumed run goes on counting from
    there.

    Several processes decide together: the main process's clock decides and
    its decision is broadcast, at the same update on every process (a stop
    on one rank only would hang the others). On one process, or on CPUs,
    the check runs at every update (a clock read); with several GPU
    processes the broadcast waits for the device, so by default it runs
    every 10 updates (``check_every``).

    :param verbose: print a line (main process) when the time is up.
    :param check_every: check every N updates (``"step"`` only); None: 1,
        or 10 with several processes on an accelerator.
    """

    name = "timer"
    changes_training = True  # it stops training

    def __init__(self, duration: str | timedelta | dict[str, float] | float | None = None,
                 interval: str = "step", verbose: bool = True, check_every: int | None = None) -> None:
        self._duration = _seconds(duration)
        if interval not in ("step", "epoch"):
            raise ValueError(f"Timer: interval must be 'step' or 'epoch', got {interval!r}")
        if check_every is not None and (not isinstance(check_every, int) or isinstance(check_every, bool)
                                        or check_every < 1):
            raise ValueError(f"Timer: check_every must be a positive int, got {check_every!r}")
        self.interval = interval
        self.verbose = verbose
        self.check_every = check_every
        self._every = 1
        self._start: dict[str, float | None] = dict.fromkeys(STAGES)
        self._end: dict[str, float | None] = dict.fromkeys(STAGES)
        self._offset: dict[str, float] = dict.fromkeys(STAGES, 0.0)  # from earlier fits and checkpoints
        #: the global_step at which the timer stopped training, or None
        self.stopped_at: int | None = None

    # -- what users ask ----------------------------------------------------

    @property
    def duration(self) -> float | None:
        """The time limit in seconds (None: none)."""
        return self._duration

    def start_time(self, stage: str = "train") -> float | None:
        """When ``stage`` last started (``time.monotonic()``), or None."""
        return self._start[_stage(stage)]

    def end_time(self, stage: str = "train") -> float | None:
        """When ``stage`` last ended (``time.monotonic()``), or None while it runs."""
        return self._end[_stage(stage)]

    def time_elapsed(self, stage: str = "train") -> float:
        """Seconds spent in ``stage`` (``"train"``: in ``fit``; ``"eval"``: in
        evaluations), over every fit of the run and its checkpoints."""
        stage = _stage(stage)
        start, offset = self._start[stage], self._offset[stage]
        if start is None or self._end[stage] is not None:
            return offset
        return offset + _now() - start

    def time_remaining(self, stage: str = "train") -> float | None:
        """Seconds left before the limit (never below 0), or None without one."""
        if self._duration is None:
            return None
        return max(0.0, self._duration - self.time_elapsed(stage))

    # -- hooks -------------------------------------------------------------

    @hookimpl(tryfirst=True)  # the clock starts before other plugins' set-up
    def on_fit_start(self, loop: LoopLike) -> None:
        self._begin("train")
        self.stopped_at = None
        acc = loop.accelerator
        if self.check_every is not None:
            self._every = self.check_every
        else:
            self._every = 10 if acc.num_processes > 1 and acc.device.type != "cpu" else 1
        self._check(loop)  # a resumed run may have used up its time already

    @hookimpl
    def after_step(self, loop: LoopLike) -> None:
        if (self.interval == "step" and loop.accelerator.sync_gradients
                and not loop.state.global_step % self._every):
            self._check(loop)

    @hookimpl
    def on_train_epoch_end(self, loop: LoopLike) -> None:
        if self.interval == "epoch":
            self._check(loop)

    @hookimpl
    def on_eval_start(self) -> None:
        self._begin("eval")

    @hookimpl
    def on_eval_end(self) -> None:
        self._finish("eval")

    @hookimpl
    def on_fit_end(self) -> None:
        self._finish("train")

    @hookimpl
    def on_exception(self) -> None:
        self._finish("eval")
        self._finish("train")

    # -- state -------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"time_elapsed": {stage: self.time_elapsed(stage) for stage in STAGES}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        elapsed = state.get("time_elapsed", {})
        for stage in STAGES:
            self._offset[stage] = float(elapsed.get(stage, 0.0))
            self._start[stage] = self._end[stage] = None

    # -- inside ------------------------------------------------------------

    def _begin(self, stage: str) -> None:
        if self._start[stage] is not None and self._end[stage] is None:
            return  # running already
        self._start[stage], self._end[stage] = _now(), None

    def _finish(self, stage: str) -> None:
        start = self._start[stage]
        if start is None or self._end[stage] is not None:
            return
        end = self._end[stage] = _now()
        self._offset[stage] += end - start

    def _check(self, loop: LoopLike) -> None:
        if self._duration is None:
            return
        stop = self.time_elapsed() >= self._duration
        acc = loop.accelerator
        if acc.num_processes > 1:  # every rank is here, at the same update
            import torch
            from accelerate.utils import broadcast

            flag = torch.tensor([1 if stop else 0], device=acc.device)
            stop = bool(broadcast(flag, from_process=0).item())
        if stop:
            self.stopped_at = loop.state.global_step
            elapsed = timedelta(seconds=int(self.time_elapsed()))
            loop.stop(f"timer: time limit {timedelta(seconds=self._duration)} reached ({elapsed} elapsed)",
                      every_rank=True)  # the main process decided for all
            if self.verbose:
                loop.print(f"Time limit reached. Elapsed time is {elapsed}. Stopping at update "
                           f"{loop.state.global_step}.")


def _stage(stage: str) -> str:
    stage = {"fit": "train", "training": "train", "validate": "eval", "validation": "eval"}.get(stage, stage)
    if stage not in STAGES:
        raise ValueError(f"Timer: stage must be one of {', '.join(STAGES)}, got {stage!r}")
    return stage


def _seconds(duration: object) -> float | None:
    if duration is None:
        return None
    if isinstance(duration, str):
        match = re.fullmatch(r"(\d+):(\d\d):(\d\d):(\d\d)", duration.strip())
        if not match:
            raise ValueError(f"Timer(duration={duration!r}) is not a valid duration: expected "
                             "'DD:HH:MM:SS' (e.g. '00:12:00:00'), a timedelta or a dict such as {'hours': 12}")
        days, hours, minutes, seconds = map(int, match.groups())
        duration = timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds)
    elif isinstance(duration, dict):
        duration = timedelta(**duration)
    elif isinstance(duration, (int, float)) and not isinstance(duration, bool):
        duration = timedelta(seconds=duration)
    if not isinstance(duration, timedelta):
        raise TypeError(f"Timer: duration must be 'DD:HH:MM:SS', a timedelta, a dict or seconds, "
                        f"got {type(duration).__name__}")
    if duration.total_seconds() < 0:
        raise ValueError(f"Timer: duration must not be negative, got {duration}")
    return duration.total_seconds()
