"""Evaluation and epoch metrics to the accelerator's trackers (a built-in default)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..markers import hookimpl

if TYPE_CHECKING:  # names for the annotations only
    from ..protocols import LoopLike


class TrackMetrics:
    """Write the metrics of a fit's evaluations to every tracker of the
    accelerator (``Accelerator(log_with=...)``), as Lightning's logger and
    the Hugging Face Trainer's ``report_to`` do: a ``fit(eval_every=N)``
    evaluation's metrics at its update, and at every epoch end the epoch's
    metrics (its evaluation's and its ``loop.log(on_epoch=True)`` values)
    with ``epoch``, at ``loop.state.global_step``. Each once: an epoch that
    ends at the update an ``eval_every`` evaluation was written at writes
    only what that one did not.

    Not written: the sanity check's metrics, and those of a
    :meth:`Loop.evaluate` a script or a plugin calls (it gets them back:
    log them under keys of their own). A plugin that writes one of these
    keys at the same step itself, before this one, wins (a default gives
    way); a plugin that writes all of them its own way (the Trainer
    adapter's ``TrainerCallbacks(trackers=True)``) declares
    ``replaces = ("track-metrics",)``, and this one then writes nothing.

    A built-in default: ``block=["track-metrics"]`` turns it off. It does
    nothing without trackers, and nothing per step: it works at
    evaluations and epoch ends only, with numbers already on the host.
    """

    name = "track-metrics"
    changes_training = False

    def __init__(self) -> None:
        self._on = False  # this fit: trackers configured, and no plugin writes the metrics instead
        self._written: tuple[int, dict[str, float]] | None = None  # (step, values) of the last write

    @hookimpl
    def on_fit_start(self, loop: LoopLike) -> None:
        plugins = loop.plugins
        replaced = any(self.name in _declared(plugins.get(name)) for name in plugins.names())
        self._on = bool(loop.accelerator.log_with) and not replaced

    @hookimpl(trylast=True)  # after the plugins that add to the metrics (or write them themselves)
    def on_eval_end(self, loop: LoopLike, metrics: Mapping[str, float]) -> None:
        if self._on and loop.state.scheduled_eval == "every":
            self._write(loop, dict(metrics))

    @hookimpl(trylast=True)  # after the plugins that add to the metrics (or write them themselves)
    def on_epoch_end(self, loop: LoopLike, epoch: int, metrics: Mapping[str, float]) -> None:
        if self._on and metrics:
            self._write(loop, {**metrics, "epoch": epoch})

    def _write(self, loop: LoopLike, values: dict[str, Any]) -> None:
        step = loop.state.global_step
        if self._written is not None and self._written[0] == step:  # this update's evaluation: written
            before = self._written[1]
            values = {k: v for k, v in values.items() if k not in before or before[k] != v}
        if values:
            loop.log(values)
            earlier = self._written[1] if self._written is not None and self._written[0] == step else {}
            self._written = (step, {**earlier, **values})


def _declared(plugin: object) -> tuple[str, ...]:
    """The plugin names ``plugin`` declares it replaces (``replaces = (...)``)."""
    declared = getattr(plugin, "replaces", ())
    return (declared,) if isinstance(declared, str) else tuple(declared or ())
