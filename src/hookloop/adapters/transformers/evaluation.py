"""Evaluations as the callbacks see them: the one ``control.should_evaluate``
asks for (the loop's ``eval_data``, else the adapter's), the batches and
examples of the one running, and its metrics named and timed as the Trainer
reports them."""

from __future__ import annotations

import time

from .logs import speed_metrics
from .values import examples, number


class Evaluations:
    """The evaluations of a
    :class:`~hookloop.adapters.transformers.TrainerCallbacks` ``plugin``
    (it reads the plugin's ``control`` and ``eval_data``)."""

    def __init__(self, plugin):
        self._plugin = plugin
        self._asked = None  # the data of the evaluation run for should_evaluate, while it runs
        self._start = time.time()
        self._batches = self._examples = 0

    def run(self, loop):
        """``control.should_evaluate``: evaluate now (the loop's
        ``eval_data``, else this adapter's); reported by ``on_eval_end``."""
        plugin = self._plugin
        data = None
        if loop.eval_data is None:
            if plugin.eval_data is None:
                plugin._warn_once(
                    "evaluate",
                    "TrainerCallbacks: a callback asked for an evaluation (control.should_evaluate), "
                    "but neither the Loop nor TrainerCallbacks(eval_data=...) has evaluation data",
                )
                plugin.control.should_evaluate = False
                return
            data = plugin.eval_data
        self._asked = data
        try:
            loop.evaluate(data)
        finally:
            self._asked = None
        plugin.control.should_evaluate = False

    def started(self, loop):
        """An evaluation starts: its clock and counts; the data it runs on."""
        self._start = time.time()
        self._batches = self._examples = 0
        return self._asked if self._asked is not None else loop.eval_data

    def count(self, batch):
        """One evaluation batch (not of the sanity check)."""
        self._batches += 1
        self._examples += examples(batch)

    def metrics(self, loop, metrics) -> dict:
        """The evaluation's ``metrics`` as the Trainer reports them:
        ``eval_<name>``, plus ``eval_runtime``, ``eval_samples_per_second``,
        ``eval_steps_per_second``."""
        n = self._examples * loop.accelerator.num_processes
        out = {}
        for key, value in metrics.items():  # the Trainer's metric_key_prefix rule
            out[key if key.startswith("eval_") else f"eval_{key}"] = number(value)
        out.update(speed_metrics("eval", self._start, num_samples=n, num_steps=self._batches))
        return out
