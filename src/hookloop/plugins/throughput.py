"""Training throughput (batches, samples, items per second) to the trackers, under
Lightning's ``ThroughputMonitor`` names, without a device sync per step."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..markers import hookimpl

if TYPE_CHECKING:  # names for the annotations only
    from ..protocols import LoopLike

#: the clock (a test may replace it)
_now = time.perf_counter


class ThroughputMonitor:
    """Every ``every`` optimizer updates, log the training throughput with
    :meth:`Loop.log <hookloop.Loop.log>` (main process), averaged over the
    last ``window`` updates::

        train/device/batches_per_sec   train/device/samples_per_sec
        train/device/items_per_sec     (with length_fn)
        train/device/flops_per_sec     (with flops_per_batch)
        train/device/mfu               (with flops_per_batch and available_flops)
        train/batches_per_sec ...      the same times the number of processes,
                                       with several processes
        train/time  train/batches  train/samples  train/lengths   totals so far

    ``device`` values are those of the main process (every process is
    assumed to train alike, as Lightning does). The clock runs only while
    training: evaluations (at epoch ends and every ``eval_every``) and the
    time between epochs are left out.

    Samples are counted on every trained batch from the length of the
    batch's first tensor (``batch_size_fn(batch)`` replaces it; a batch
    with no tensor is an error naming this plugin); ``length_fn(batch)``
    counts items (tokens, say: ``lambda b: b["attention_mask"].numel()``;
    it must return a Python number without reading the device).

    Costs no device sync per step: times are read with
    ``time.perf_counter`` at the logging points only, and with
    ``synchronize=True`` (the default) the device is synchronised there,
    once per ``every`` updates, so that each window is measured exactly.
    ``synchronize=False`` avoids even that; the rates are then off by at
    most the few steps the host runs ahead of the device, over the window.

    :param every: log every N updates (>= 1).
    :param window: average over the last ``window`` updates (rounded up to
        a multiple of ``every``); the first logs average over what there is.
    :param flops_per_batch: floating-point operations of one training batch
        on one device (forward and backward).
    :param available_flops: the device's peak FLOP/s, for ``mfu``.
    :param separator: between key parts (Lightning's ``/``).

    :attr:`last` holds the values of the last log.
    """

    name = "throughput"
    changes_training = False

    def __init__(self, batch_size_fn: Callable[[Any], int] | None = None,
                 length_fn: Callable[[Any], float] | None = None, *, every: int = 50,
                 window: int = 100, flops_per_batch: float | None = None,
                 available_flops: float | None = None, synchronize: bool = True,
                 separator: str = "/") -> None:
        for label, value in (("every", every), ("window", window)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ThroughputMonitor: {label} must be a positive int, got {value!r}")
        self.batch_size_fn = batch_size_fn
        self.length_fn = length_fn
        self.every = every
        self.window = window
        self.flops_per_batch = flops_per_batch
        self.available_flops = available_flops
        self.synchronize = synchronize
        self.separator = separator
        #: the values of the last log
        self.last: dict[str, float] = {}
        self._active = False
        self._reset()

    def _reset(self) -> None:
        self.batches: int = 0
        self.samples: int = 0
        self.lengths: float = 0  # what length_fn counted: a Python number
        self._time = 0.0  # training seconds before the clock last started
        self._since: float | None = None  # perf_counter() when the clock last started; None: stopped
        self._evaluating = False  # the clock was stopped for an evaluation inside the epoch
        # (time, batches, samples, lengths) at each logging point, and at the start
        self._points: deque[tuple[float, int, int, float]] = deque(maxlen=-(-self.window // self.every) + 1)

    # -- hooks -------------------------------------------------------------

    @hookimpl
    def on_fit_start(self, loop: LoopLike) -> None:
        acc = loop.accelerator
        self._active = acc.is_main_process
        self._device = acc.device
        self._world = acc.num_processes
        self._reset()
        self._points.append((0.0, 0, 0, 0))
        self.last = {}

    @hookimpl
    def on_epoch_start(self) -> None:
        if self._active:
            self._start_clock()

    @hookimpl
    def after_step(self, loop: LoopLike, batch: Any) -> None:
        if not self._active:
            return
        self.batches += 1
        self.samples += self.batch_size_fn(batch) if self.batch_size_fn is not None else _batch_size(batch)
        if self.length_fn is not None:
            self.lengths += self.length_fn(batch)
        if loop.accelerator.sync_gradients and not loop.state.global_step % self.every:
            self._log(loop)

    @hookimpl
    def on_eval_start(self) -> None:
        # an evaluation inside the epoch (eval_every): its time is not training time
        self._evaluating = self._active and self._since is not None
        if self._evaluating:
            self._stop_clock()

    @hookimpl
    def on_eval_end(self) -> None:
        if self._evaluating:
            self._evaluating = False
            self._start_clock()

    @hookimpl
    def on_train_epoch_end(self) -> None:
        if self._active:
            self._stop_clock()

    @hookimpl
    def on_fit_end(self) -> None:
        if self._active:
            self._stop_clock()

    @hookimpl
    def on_exception(self) -> None:
        if self._active:
            self._since = None

    # -- inside ------------------------------------------------------------

    def _start_clock(self) -> None:
        if self._since is None:
            self._since = _now()

    def _stop_clock(self) -> None:
        if self._since is not None:
            self._sync()
            self._time += _now() - self._since
            self._since = None

    def _clock(self) -> float:
        if self._since is None:
            return self._time
        return self._time + _now() - self._since

    def _sync(self) -> None:
        if self.synchronize and self._device.type != "cpu":
            module = getattr(torch, self._device.type, None)
            if module is not None and hasattr(module, "synchronize"):
                module.synchronize()

    def _log(self, loop: LoopLike) -> None:
        self._sync()
        self._points.append((self._clock(), self.batches, self.samples, self.lengths))
        t0, b0, s0, l0 = self._points[0]  # ``window`` updates ago (or the start)
        t, b, s, n = self._points[-1]
        sep = self.separator
        values: dict[str, float] = {f"train{sep}time": t, f"train{sep}batches": b, f"train{sep}samples": s}
        if self.length_fn is not None:
            values[f"train{sep}lengths"] = n
        elapsed = t - t0
        if elapsed > 0:
            rates = {"batches_per_sec": (b - b0) / elapsed, "samples_per_sec": (s - s0) / elapsed}
            if self.length_fn is not None:
                rates["items_per_sec"] = (n - l0) / elapsed
            if self.flops_per_batch is not None:
                rates["flops_per_sec"] = rates["batches_per_sec"] * self.flops_per_batch
            for key, value in rates.items():
                values[f"train{sep}device{sep}{key}"] = value
                if self._world > 1:
                    values[f"train{sep}{key}"] = value * self._world
            if self.flops_per_batch is not None and self.available_flops:
                values[f"train{sep}device{sep}mfu"] = rates["flops_per_sec"] / self.available_flops
        self.last = values
        loop.log(values)


def _batch_size(batch: Any) -> int:
    """The length of the first tensor in ``batch`` (a tensor, a mapping's
    values or a sequence's items, depth first)."""
    size = _first_length(batch)
    if size is None:
        raise TypeError(
            f"ThroughputMonitor: no tensor in the batch ({type(batch).__name__}) to count samples "
            "from: pass ThroughputMonitor(batch_size_fn=lambda batch: ...)"
        )
    return size


def _first_length(batch: Any) -> int | None:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        size = _first_length(item)
        if size is not None:
            return size
    return None
