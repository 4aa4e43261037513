"""Stop training when a monitored metric has stopped improving.

::

    loop = Loop(..., eval_data=eval_dataloader,
                plugins=[("early-stopping", {"monitor": "eval_loss", "patience": 3})])

At every epoch end the plugin reads ``metrics[monitor]`` (the evaluation
metrics, plus whatever ``on_epoch_end`` plugins given before it in
``plugins=[...]`` added). An epoch
improves on the best so far when the value is lower (``mode="min"``) or
higher (``mode="max"``) by more than ``min_delta``. After ``patience`` epochs
in a row without improvement it calls ``loop.stop(...)``: that epoch is the
last one.
"""

from __future__ import annotations

import math

from hookloop import hookimpl

__version__ = "0.1.0"

__all__ = ["EarlyStopping"]


class EarlyStopping:
    """Stop after ``patience`` epochs without improvement of ``monitor``.

    :param monitor: the metric to watch, a key of the epoch-end metrics
        (``"eval_loss"``, ``"eval_accuracy"``, or one a plugin adds).
    :param mode: ``"min"`` (lower is better) or ``"max"``.
    :param patience: epochs without improvement before stopping (>= 1).
    :param min_delta: the smallest change that counts as an improvement.

    A missing metric is an error naming the metrics there are (a typo would
    otherwise never stop anything). A NaN never improves. The evaluation
    metrics are averaged over all processes, so every process stops at the
    same epoch. Its state (best value, epochs waited) is plugin state,
    saved with checkpoints (:meth:`state_dict`).
    """

    name = "early-stopping"
    changes_training = True  # stops training (shown by `hookloop plugins`)

    def __init__(self, monitor: str = "eval_loss", mode: str = "min", patience: int = 3,
                 min_delta: float = 0.0):
        if mode not in ("min", "max"):
            raise ValueError(f"EarlyStopping: mode must be 'min' or 'max', got {mode!r}")
        if not isinstance(patience, int) or isinstance(patience, bool) or patience < 1:
            raise ValueError(f"EarlyStopping: patience must be a positive int, got {patience!r}")
        if not min_delta >= 0:
            raise ValueError(f"EarlyStopping: min_delta must be >= 0, got {min_delta!r}")
        self.monitor = monitor
        self.mode = mode
        self.patience = patience
        self.min_delta = float(min_delta)
        #: the best value seen, the epoch it was seen at, epochs since
        self.best: float | None = None
        self.best_epoch: int | None = None
        self.wait = 0
        #: the epoch after which it stopped training (None: it did not)
        self.stopped_epoch: int | None = None

    def improves(self, value: float) -> bool:
        """Whether ``value`` beats the best so far by more than ``min_delta``."""
        if math.isnan(value):
            return False
        if self.best is None:
            return True
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    @hookimpl
    def on_eval_end(self, loop, metrics):
        # the sanity check's evaluation: a misspelt monitor fails in seconds, not after an epoch
        if loop.state.stage == "sanity" and self.monitor not in metrics and not self.monitor.startswith("train"):
            raise KeyError(
                f"early-stopping monitors {self.monitor!r}, but the evaluation's metrics are "
                f"{sorted(metrics) or 'empty'}; pass monitor=... with one of them"
            )

    # not trylast: a checkpoint plugin saves at epoch end as late as it can
    # (trylast), and must find this epoch already counted. Plugins that add
    # metrics go before this one in plugins=[...].
    @hookimpl
    def on_epoch_end(self, loop, epoch, metrics):
        if self.monitor not in metrics:
            raise KeyError(
                f"early-stopping monitors {self.monitor!r}, but the epoch-end metrics are "
                f"{sorted(metrics) or 'empty (is eval_data set?)'}; pass monitor=... "
                f"with one of them"
            )
        value = float(metrics[self.monitor])
        if self.improves(value):
            self.best, self.best_epoch, self.wait = value, epoch, 0
            return
        self.wait += 1
        if self.wait >= self.patience:
            self.stopped_epoch = epoch
            best = "none yet" if self.best is None else f"best {self.best:.6g} at epoch {self.best_epoch}"
            loop.stop(f"early stopping: {self.monitor} did not improve for {self.wait} epoch(s); {best}")

    def state_dict(self) -> dict:
        """Plain data for a checkpoint."""
        return {"best": self.best, "best_epoch": self.best_epoch, "wait": self.wait,
                "stopped_epoch": self.stopped_epoch}

    def load_state_dict(self, state: dict) -> None:
        self.best = state["best"]
        self.best_epoch = state["best_epoch"]
        self.wait = state["wait"]
        self.stopped_epoch = state["stopped_epoch"]
