"""Loss, learning rates and gradient norms to Accelerate's trackers and the console."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from ..markers import hookimpl
from ..network import NOT_MEASURED

if TYPE_CHECKING:  # names for the annotations only
    from torch import Tensor

    from ..protocols import LoopLike


class Logger:
    """Every ``every`` optimizer updates, log the loss of the batch that
    completed the update (averaged over processes), every param group's
    learning rate (``lr``, ``lr/group1``, ...; with several networks
    ``lr/<network>``, ``lr/<network>/group1``) and, when a clipping plugin
    measured it, the gradient norm; with ``console=True``, at every epoch
    end, the epoch's metrics on one line.

    Values go through :meth:`Loop.log` to every tracker Accelerate supports
    (``Accelerator(log_with="tensorboard", project_dir=...)``, W&B, ...,
    or :class:`hookloop.trackers.JSONLinesTracker`) and, with
    ``console=True``, to one printed line. Only the main process writes.
    The epoch's and the evaluations' metrics reach the trackers through the
    built-in default :class:`~hookloop.plugins.TrackMetrics`, with or
    without a Logger (before 0.4 the Logger wrote them).

    ``every`` is not 1 by default: reading a loss value synchronises a GPU.
    What it reads from the device, every ``every`` updates and nowhere else:
    each loss (``.item()``, after a mean over processes) and each gradient
    norm a clipping plugin measured (``float()``).
    ``project_name`` and ``config`` are what the trackers are started with
    (``accelerator.init_trackers``); the loop finishes them when the fit ends.
    Several loggers may run side by side (``logger``, ``logger-2``): an
    instance not named ``logger`` writes its keys under its name
    (``logger-2/loss``, ``fast/lr``), so that two never write one key.
    """

    name = "logger"
    changes_training = False

    def __init__(self, every: int = 50, console: bool = True, project_name: str = "hookloop",
                 config: dict[str, Any] | None = None) -> None:
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"Logger: every must be a positive int, got {every!r}")
        self.every = every
        self.console = console
        self.project_name = project_name
        self.config = config
        self._prefix = ""

    @property
    def prints_what_it_logs(self) -> bool:
        """With ``console=True`` every value it logs is also printed: without
        a tracker ``loop.log`` does not say that they go to no tracker."""
        return self.console

    @hookimpl(tryfirst=True)  # before any plugin logs: the trackers get this project name
    def on_fit_start(self, loop: LoopLike) -> None:
        loop.start_trackers(self.project_name, config=self.config)
        name = loop.plugins.name_of(self)
        self._prefix = "" if name in (None, "logger") else f"{name}/"

    @hookimpl
    def after_step(self, loop: LoopLike, loss: Tensor | Mapping[str, Tensor]) -> None:
        step = loop.state.global_step
        if step % self.every or not loop.accelerator.sync_gradients:
            return  # (not after a micro-batch that completed no update)
        accelerator = loop.accelerator
        losses: Iterable[tuple[str | None, Tensor]] = (
            loss.items() if isinstance(loss, Mapping) else [(None, loss)])
        values: dict[str, float] = {}
        for name, value in losses:
            value = value.detach()
            if accelerator.num_processes > 1:  # a collective: every rank is here
                value = accelerator.reduce(value, reduction="mean")
            values["loss" if name is None else f"loss/{name}"] = value.item()
        several = len(loop.networks) > 1
        for name, network in loop.networks.items():
            suffix = f"/{name}" if several else ""
            if network.optimizer is not None:
                for i, group in enumerate(network.optimizer.param_groups):
                    values["lr" + suffix + (f"/group{i}" if i else "")] = group["lr"]
            if network.grad_norm is not NOT_MEASURED:
                values["grad_norm" + suffix] = float(network.grad_norm)
        loop.log({self._prefix + k: v for k, v in values.items()})
        if self.console:
            loop.print(f"step {step} " + " ".join(f"{k} {_fmt(v)}" for k, v in values.items()))

    @hookimpl
    def on_epoch_end(self, loop: LoopLike, epoch: int, metrics: Mapping[str, float]) -> None:
        if metrics and self.console:  # (the trackers get them from TrackMetrics)
            loop.print(f"epoch {epoch} " + " ".join(f"{k} {_fmt(v)}" for k, v in metrics.items()))


def _fmt(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
