"""The built-in progress on the main process: a tqdm bar on a terminal,
plain lines without one.

Without a terminal (``sbatch``, ``nohup``, ``python train.py > out.log
2>&1``, CI) a bar is either silent (tqdm's choice) or a flood of carriage
returns; there the plugin prints a plain line now and then instead, and one
line of metrics at each epoch's end. Neither mode ever waits for the device.
"""

from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Mapping
from datetime import timedelta
from time import monotonic
from typing import Any, TextIO

import torch
from tqdm.auto import tqdm

from ..markers import hookimpl

#: what a fit shows, decided when it starts (``ProgressBar.mode``; None: nothing)
BAR, LINES = "bar", "lines"
_NEVER = sys.maxsize  # an update no fit reaches (an int: compared with global_step at every update)


class ProgressBar:
    """The fit's progress, counting optimizer updates, with their rate and
    the loss, without ever waiting for the device: a tqdm bar on a terminal,
    plain lines without one. Only the main process shows anything.

    **Bar or lines** is decided when each ``fit`` starts, by the test tqdm
    itself makes: whether the stream it writes to, ``sys.stderr``, is a
    terminal (a Jupyter notebook counts as one). On a terminal, one bar for
    the whole fit and nothing else. Without one (``sbatch``, ``nohup``,
    ``> out.log 2> err.log``, CI) plain lines, never a carriage return::

        update 1/20000 (0%) | epoch 0 | loss 2.303 | 2.2 s/update | 0:00:02 elapsed, 12:13:18 left
        update 187/20000 (0%) | epoch 0 | loss 1.874 | 3.1 updates/s | 0:01:02 elapsed, 1:46:31 left
        ...
        update 2000/20000 (10%) | epoch 0 | loss 0.6127 | 3.1 updates/s | 0:10:47 elapsed, 1:36:46 left
        ...
        epoch 0 eval_loss 0.4411 eval_accuracy 0.8634

    A progress line at the fit's first update, at every ``line_updates``-th
    update (default: every tenth of the run), whenever ``line_seconds``
    (60) have passed since the last line, whichever comes first, and at the
    last update; at each epoch's end, the epoch's metrics (``on_epoch_end``'s)
    on one line. The rate counts this fit's updates over the wall time since
    its first line (on the first line: since the fit started, setup
    included; a resumed fit counts from where it resumed); time left is the
    updates left at that rate. The lines go where the bar goes, to
    ``sys.stderr``, flushed at once, so that ``stdout`` stays the program's.

    ``lines=True`` prints the lines even on a terminal, with no bar;
    ``lines=False`` never (without a terminal: nothing, as before 0.4);
    ``disable=False`` draws the bar even without a terminal (tqdm's
    meaning: carriage returns in the log); ``disable=True``, or blocking
    ``"progress"`` (``Loop(block=["progress"])``,
    ``HOOKLOOP_BLOCK_PLUGINS=progress``), shows neither.

    **The loss without waiting.** The loss is copied to the host
    asynchronously (``.to("cpu", non_blocking=True)``, with a CUDA event to
    know when it has arrived): for the bar every ``every`` updates, which
    shows the newest copy that has arrived (a few updates old); for the
    lines at each line's update, and the line is printed when that copy has
    arrived (at once from the host; from a GPU a few updates later, the
    device running at most a few updates behind). A line still waiting at
    an epoch's end is printed there with the newest copy that has arrived,
    or with no loss if none has. No ``.item()`` on a device tensor: the
    training pipeline never stalls for the progress. Without a tracker, the
    latest ``loop.log`` values (``on_step``) ride in the same copies and are
    shown after the loss (Lightning's ``prog_bar=True``); with a tracker
    they go to the tracker only.

    Per update the lines cost a comparison and one ``time.monotonic()``,
    no allocation (~0.1 µs); the bar, tqdm's ``update`` and a copy every
    ``every`` updates.
    """

    name = "progress"
    changes_training = False

    def __init__(self, every: int = 10, disable: bool | None = None, leave: bool = True, *,
                 lines: bool | None = None, line_updates: int | None = None,
                 line_seconds: float | None = 60.0) -> None:
        _check_count("every", every)
        if line_updates is not None:
            _check_count("line_updates", line_updates)
        if line_seconds is not None and (isinstance(line_seconds, bool) or not isinstance(
                line_seconds, numbers.Real) or not line_seconds > 0):
            raise ValueError(f"ProgressBar: line_seconds must be a positive number of seconds or None "
                             f"(no line by time), got {line_seconds!r}")
        for option, value in (("disable", disable), ("lines", lines)):
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"ProgressBar: {option} is None (decide by the terminal), True or False, "
                                 f"got {value!r}")
        if disable is False and lines is True:
            raise ValueError("ProgressBar(disable=False, lines=True): disable=False draws the bar even "
                             "without a terminal, lines=True prints plain lines instead of the bar; "
                             "give one of them")
        self.every = every
        self.disable = disable
        self.leave = leave
        self.lines = lines
        self.line_updates = line_updates
        self.line_seconds = line_seconds
        self.bar: Any = None  # the tqdm bar, while a fit shows one
        self.mode: str | None = None  # BAR, LINES or None (nothing), decided at each fit's start
        self._copies: list[tuple[Any, dict[str, Any]]] = []  # [(ready: event or None, {key: host copy})], oldest first
        self._latest: dict[str, Any] = {}  # the newest copy that has arrived
        self._logged: Mapping[str, Any] | None = None  # loop.log's latest values that no tracker took
        self._logbook: Any = None  # the loop's (hookloop.logbook.Logbook), while a fit runs
        self._file: TextIO = sys.stderr
        # the lines' schedule: line at the update _next_line or at the time _deadline
        self._total: int | None = None
        self._line_every: int | None = None
        self._next_line = _NEVER
        self._deadline = math.inf
        self._fit_start = (0, 0.0)  # (global_step, monotonic()) when the fit started
        self._window: tuple[int, float] | None = None  # (global_step, time) of the fit's first line
        self._due: int | None = None  # the update whose line waits for its copy

    @hookimpl
    def on_fit_start(self, loop):
        self._copies, self._latest, self.mode = [], {}, None
        if not loop.accelerator.is_main_process or self.disable is True:
            return
        # without a tracker the logbook keeps loop.log's latest values for us
        self._logbook = getattr(loop, "_logbook", None)
        self._logged = getattr(self._logbook, "untracked", None)
        self._file = sys.stderr
        if self.lines is not True:  # tqdm decides: no terminal, no bar (unless disable=False)
            bar = tqdm(total=loop.total_steps, initial=loop.state.global_step, disable=self.disable,
                       leave=self.leave, unit="step", dynamic_ncols=True)
            if not bar.disable:
                self.bar, self.mode = bar, BAR
                self._shows_untracked("the progress bar")
                return
            bar.close()
            if self.lines is False:
                return
        self._start_lines(loop)
        self._shows_untracked("the progress lines")

    def _shows_untracked(self, where):
        """Tell the logbook that loop.log's untracked values are shown (its
        message without a tracker says where); None when the fit is over."""
        if self._logbook is not None and hasattr(self._logbook, "untracked_shown_by"):
            self._logbook.untracked_shown_by = where

    def _start_lines(self, loop):
        step, total = loop.state.global_step, loop.total_steps
        self.mode, self._total = LINES, total
        self._line_every = self.line_updates or (math.ceil(total / 10) if total else None)
        self._fit_start, self._window, self._due = (step, monotonic()), None, None
        self._next_line, self._deadline = step + 1, math.inf  # the fit's first update has its line

    @hookimpl
    def on_epoch_start(self, loop, epoch):
        if self.bar is not None:
            self.bar.set_description(f"epoch {epoch}", refresh=False)

    @hookimpl
    def after_step(self, loop, loss):
        mode = self.mode
        if mode is LINES:  # (whether the batch completed an update: asked only when a line is due)
            step = loop.state.global_step
            if (step >= self._next_line or monotonic() >= self._deadline) and loop.accelerator.sync_gradients:
                self._line_due(loop, step, loss)
        elif mode is BAR and loop.accelerator.sync_gradients:  # one tick per optimizer update
            self.bar.update(1)
            if loop.state.global_step % self.every == 0:
                self._copy(loss)

    def _line_due(self, loop, step, loss):
        """A line is due: copy this update's loss to the host and print the
        line once the copy has arrived: at once from the host, a few updates
        later from a GPU (the device runs at most a few updates behind). The
        epoch's end prints a line still waiting, with the newest copy there."""
        if self._due is None:
            self._due = step
            self._copy(loss)
        self._take_arrived()
        if self._copies:
            self._next_line = step + 1  # not there yet: look again at the next update
        else:
            self._print_line(loop, step)

    def _copy(self, loss):
        """Start the host copy of ``loss`` (and of loop.log's untracked values)."""
        self._take_arrived()
        if isinstance(loss, Mapping):
            values = {f"loss/{k}": v for k, v in loss.items() if v is not None}
        else:
            values = {} if loss is None else {"loss": loss}
        if self._logged:
            values.update((k, v) for k, v in self._logged.items() if k not in values and v is not None)
        self._copies.append(_to_host(values))

    def _take_arrived(self):
        """Keep (and show on the bar) the newest copy that has arrived; drop the older ones."""
        arrived = None
        copies = self._copies
        while copies and (copies[0][0] is None or copies[0][0].query()):
            arrived = copies.pop(0)[1]
        if arrived:
            self._latest = arrived
            if self.mode is BAR:  # (losses as before 0.4: 4 decimals)
                losses = {k for k in arrived if k == "loss" or k.startswith("loss/")}
                self.bar.set_postfix({k: f"{float(v):.4f}" if k in losses else _fmt(v)
                                      for k, v in arrived.items()}, refresh=False)

    def _print_line(self, loop, step):
        """``update 2000/20000 (10%) | epoch 0 | loss 0.6127 | 3.1 updates/s | 0:10:47 elapsed, 1:36:46 left``"""
        now = monotonic()
        self._due = None
        since_step, since = self._window or self._fit_start
        if self._window is None:
            self._window = (step, now)  # the rate of later lines leaves the first update's setup out
        rate = (step - since_step) / (now - since) if step > since_step and now > since else None
        total = self._total
        parts = [f"update {step}/{total} ({step * 100 // total}%)" if total else f"update {step}",
                 f"epoch {loop.state.epoch}"]
        if self._latest:
            parts.append(" ".join(f"{k} {_fmt(v)}" for k, v in self._latest.items()))
        if rate is not None:
            parts.append(f"{rate:.1f} updates/s" if rate >= 1 else f"{1 / rate:.1f} s/update")
        times = f"{_duration(now - self._fit_start[1])} elapsed"
        if rate is not None and total:
            times += f", {_duration((total - step) / rate)} left"
        parts.append(times)
        print(" | ".join(parts), file=self._file, flush=True)
        every = self._line_every
        self._next_line = _NEVER if every is None else (step // every + 1) * every
        if total:
            self._next_line = min(self._next_line, total)  # the last update has its line
        self._deadline = math.inf if self.line_seconds is None else now + self.line_seconds

    def _print_waiting(self, loop):
        """The line still waiting for its copy, with the newest copy there."""
        if self._due is not None:
            self._take_arrived()
            self._print_line(loop, loop.state.global_step)

    @hookimpl
    def on_epoch_end(self, loop, epoch, metrics):
        if self.mode is LINES:  # (the main process; on a terminal the bar is the progress)
            self._print_waiting(loop)
            shown = " ".join(f"{k} {_fmt(v)}" for k, v in metrics.items())
            print(f"epoch {epoch} {shown or 'ended (no metrics)'}", file=self._file, flush=True)

    @hookimpl
    def on_fit_end(self, loop):
        if self.mode is LINES:
            self._print_waiting(loop)
        self._close()

    @hookimpl
    def on_exception(self, loop, exception):
        self._close()

    def _close(self):
        if self.mode is not None:
            self._shows_untracked(None)
        self._copies, self._latest, self._logged, self.mode = [], {}, None, None
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _check_count(option: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"ProgressBar: {option} must be a positive number of updates, got {value!r}")


def _to_host(values: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``(event or None, host copies)``: tensors' copies started without
    waiting (other values as they are); the event (CUDA) tells when they have
    arrived, None: already there."""
    copies = {k: v.detach().to("cpu", non_blocking=True) if isinstance(v, torch.Tensor) else v
              for k, v in values.items()}
    event = None
    if any(isinstance(v, torch.Tensor) and v.is_cuda for v in values.values()):
        event = torch.cuda.Event()
        event.record()
    return event, copies


def _fmt(value: Any) -> str:
    """A host value as a line shows it: 4 significant digits for a real number."""
    if isinstance(value, torch.Tensor):
        value = value.item()  # a host copy
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
        return f"{float(value):.4g}"
    return str(value)


def _duration(seconds: float) -> str:
    """``0:07:14``, ``1 day, 2:03:04``."""
    return str(timedelta(seconds=round(seconds)))
