"""Profile a window of training updates with ``torch.profiler``, as Lightning's
``PyTorchProfiler`` does: a trace per process, and the top operators printed."""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch.profiler
from torch.profiler import ProfilerAction, ProfilerActivity

from ..markers import hookimpl

if TYPE_CHECKING:  # names for the annotations only
    from ..protocols import LoopLike

#: the ``sort_by`` keys of torch's ``EventList.table`` (``cuda`` stands for any device)
SORT_KEYS = frozenset({
    "cpu_time", "cuda_time", "cpu_time_total", "cuda_time_total", "self_cpu_time_total",
    "self_cuda_time_total", "cpu_memory_usage", "cuda_memory_usage", "self_cpu_memory_usage",
    "self_cuda_memory_usage", "count",
})

_RECORDING = (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE)


class Profiler:
    """Profile a window of optimizer updates with :mod:`torch.profiler`:
    write a trace of every process and print the operators that took the
    most time (Lightning's ``Trainer(profiler="pytorch")`` /
    ``PyTorchProfiler``)::

        loop = Loop(..., plugins=[Profiler(dir="profiler")])
        loop.fit(epochs=1)   # profiler/rank0.<ns>.pt.trace.json, and the table

    The window is ``torch.profiler.schedule(skip_first=, wait=, warmup=,
    active=, repeat=)`` counted in optimizer updates from the start of each
    ``fit`` (one step per update, not per micro-batch under gradient
    accumulation; a GAN's batch is one update). The default skips the first
    update (start-up costs: allocator, kernels chosen, caches), warms up on
    the second and records updates 3 to 5. In the trace,
    ``ProfilerStep#k`` is the fit's update ``k + 1``: the data loading, the
    hooks and the step of that update.

    When a window ends (or the fit, if first), each process writes its trace
    to ``dir/rank<N>.<ns>.pt.trace.json`` (the name
    ``torch.profiler.tensorboard_trace_handler`` gives, the worker named by
    its rank): a Chrome trace that Perfetto (https://ui.perfetto.dev),
    ``chrome://tracing`` and TensorBoard's profiler plugin (``tensorboard
    --logdir`` on the folder above ``dir``) open. The main process prints
    ``key_averages().table()`` sorted by ``sort_by``. Every process is
    profiled (a profiled rank runs slower; profiling one alone would make the
    others wait on it in every collective and misplace the time); only the
    main process prints. After the last window (``repeat`` of them; ``0``:
    until the fit ends) the profiler is stopped: what is left of the fit
    costs one check per batch. Not registered, it costs nothing.

    Only training is profiled: an evaluation that falls inside a recording
    window (``eval_every``, an epoch's end) is left out of the trace and the
    table (torch's ``toggle_collection_dynamic``, torch >= 2.5; before that it
    is recorded with the update it follows). ``loop.evaluate()`` and
    ``loop.predict()`` are not profiled. A fit that raises stops the profiler
    and writes nothing; a fit that ends before its window warns.

    :param dir: the folder for the traces (made when the first is written).
    :param wait, warmup, active, repeat, skip_first: the schedule, as
        ``torch.profiler.schedule`` takes them (updates).
    :param activities: ``torch.profiler.ProfilerActivity`` values; default
        CPU, and CUDA when the accelerator's device is a CUDA device.
    :param record_shapes, profile_memory, with_stack: passed to
        ``torch.profiler.profile`` (each costs time while recording).
    :param row_limit: rows of the printed table (``-1``: all; ``0``: no table).
    :param sort_by: the table's order (:data:`SORT_KEYS`); default
        ``"self_cuda_time_total"`` when CUDA is profiled, else
        ``"self_cpu_time_total"``.

    :attr:`traces` lists the files this process wrote, :attr:`tables` the
    tables printed (main process).
    """

    name = "torch-profiler"  # "profiler" is the installed hookloop-profiler's (hook timings)
    changes_training = False

    def __init__(self, dir: str | os.PathLike[str], *, wait: int = 1, warmup: int = 1, active: int = 3,
                 repeat: int = 1, skip_first: int = 0, activities: Iterable[ProfilerActivity] | None = None,
                 record_shapes: bool = False, profile_memory: bool = False, with_stack: bool = False,
                 row_limit: int = 20, sort_by: str | None = None) -> None:
        if not torch.profiler.kineto_available():
            raise RuntimeError("Profiler: this torch build has no Kineto "
                               "(torch.profiler.kineto_available() is False)")
        if not isinstance(dir, (str, os.PathLike)):
            raise TypeError(f"Profiler: dir must be a path, got {dir!r}")
        for label, value, least in (("wait", wait, 0), ("warmup", warmup, 0), ("active", active, 1),
                                    ("repeat", repeat, 0), ("skip_first", skip_first, 0),
                                    ("row_limit", row_limit, -1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"Profiler: {label} must be an int >= {least}, got {value!r}")
        if sort_by is not None and sort_by not in SORT_KEYS:
            raise ValueError(f"Profiler: sort_by must be one of {sorted(SORT_KEYS)}, got {sort_by!r}")
        self.activities = None if activities is None else list(activities)
        for activity in self.activities or ():
            if not isinstance(activity, ProfilerActivity):
                raise TypeError(f"Profiler: activities must be torch.profiler.ProfilerActivity values, "
                                f"got {activity!r}")
        self.dir = Path(dir)
        self.wait, self.warmup, self.active = wait, warmup, active
        self.repeat, self.skip_first = repeat, skip_first
        self.record_shapes, self.profile_memory, self.with_stack = record_shapes, profile_memory, with_stack
        self.row_limit = row_limit
        self.sort_by = sort_by
        #: the trace files this process wrote
        self.traces: list[Path] = []
        #: the tables the main process printed
        self.tables: list[str] = []
        self._profiler: torch.profiler.profile | None = None
        self._schedule: Callable[[int], ProfilerAction] = torch.profiler.schedule(
            wait=wait, warmup=warmup, active=active, repeat=repeat, skip_first=skip_first)
        # updates after which the last window has ended (None: it never does)
        self._end = skip_first + repeat * (wait + warmup + active) if repeat else None
        self._seen = 0  # loop.state.global_step at the last profiler step
        self._first = 0  # loop.state.global_step when the fit started
        self._paused = False  # collection switched off for an evaluation
        self._windows = 0  # traces written in this fit
        self._activities: list[ProfilerActivity] = []
        self._main = True
        self._print: Callable[[str], None] = print
        self._worker = "rank0"
        self._sort = "self_cpu_time_total"

    # -- hooks -------------------------------------------------------------

    @hookimpl
    def on_fit_start(self, loop: LoopLike) -> None:
        self._close()  # a profiler left by an earlier fit that did not end (never expected)
        acc = loop.accelerator
        activities = self.activities
        if activities is None:
            activities = [ProfilerActivity.CPU]
            if acc.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
        self._activities = activities
        self._sort = self.sort_by or ("self_cuda_time_total" if ProfilerActivity.CUDA in activities
                                      else "self_cpu_time_total")
        self._main = acc.is_main_process
        self._print = loop.print
        self._worker = f"rank{acc.process_index}"
        self._first = self._seen = loop.state.global_step
        self._windows = 0
        profiler = torch.profiler.profile(
            activities=activities, schedule=self._schedule, on_trace_ready=self._trace_ready,
            record_shapes=self.record_shapes, profile_memory=self.profile_memory, with_stack=self.with_stack,
        )
        profiler.start()  # records nothing before the schedule says so
        self._profiler = profiler

    @hookimpl
    def after_step(self, loop: LoopLike) -> None:
        profiler = self._profiler
        if profiler is None or loop.state.global_step == self._seen:
            return  # no window left, or a micro-batch that completed no update
        self._seen = loop.state.global_step
        profiler.step()
        if self._end is not None and profiler.step_num >= self._end:
            self._close()  # past the last window: nothing more per update

    @hookimpl
    def on_eval_start(self) -> None:
        profiler = self._profiler
        if profiler is None or profiler.current_action not in _RECORDING:
            return
        toggle = getattr(profiler, "toggle_collection_dynamic", None)  # torch >= 2.5
        if toggle is not None:
            toggle(False, self._activities)
            self._paused = True

    @hookimpl
    def on_eval_end(self) -> None:
        if self._paused:
            self._paused = False
            if self._profiler is not None:
                self._profiler.toggle_collection_dynamic(True, self._activities)

    @hookimpl
    def on_fit_end(self) -> None:
        profiler = self._profiler
        if profiler is None:
            return
        # the fit ends inside a window: its trace is written and printed, if the
        # window holds an update (ProfilerStep#k is update k + 1: the last is #step_num - 1)
        if profiler.step_num == 0 or self._schedule(profiler.step_num - 1) not in _RECORDING:
            profiler.on_trace_ready = None
            if not self._windows and self._main:
                first = self.skip_first + self.wait + self.warmup + 1
                warnings.warn(
                    f"Profiler: the fit ended after {profiler.step_num} updates, before update {first}, "
                    "the first it records: no trace written (lower skip_first, wait or warmup)",
                    RuntimeWarning, stacklevel=2)
        self._close()

    @hookimpl
    def on_exception(self) -> None:
        if self._profiler is not None:
            self._profiler.on_trace_ready = None  # a failed fit's partial window is not reported
            self._close()

    # -- the profiler --------------------------------------------------------

    def _close(self) -> None:
        profiler, self._profiler = self._profiler, None
        self._paused = False
        if profiler is not None:
            profiler.stop()

    def _trace_ready(self, profiler: torch.profiler.profile) -> None:
        """torch's ``on_trace_ready``: a window has ended (or the fit inside one)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"{self._worker}.{time.time_ns()}.pt.trace.json"
        profiler.export_chrome_trace(str(path))
        self.traces.append(path)
        self._windows += 1
        if not self._main or self.row_limit == 0:
            return
        # the updates recorded: the last ``active`` profiler steps the schedule recorded
        done = profiler.step_num
        recorded = [k for k in range(max(0, done - self.active), done) if self._schedule(k) in _RECORDING]
        first, last = self._first + recorded[0] + 1, self._first + recorded[-1] + 1
        table = profiler.key_averages().table(sort_by=self._sort, row_limit=self.row_limit)
        self.tables.append(table)
        updates = f"update {first}" if first == last else f"updates {first}-{last}"
        self._print(f"Profiler: {updates} (global_step), by {self._sort}; trace {path}\n{table}")
