"""Loss, learning rate and gradient norm to Accelerate's trackers and the console."""

from collections.abc import Mapping

from ..markers import hookimpl


class Logger:
    """Every ``every`` optimizer updates, log the loss (of the batch that
    completed the update) (averaged over processes), each
    network's learning rate and, when a clipping plugin measured it, its
    gradient norm; at every epoch end, the epoch's metrics.

    Values go to ``accelerator.log`` — every tracker Accelerate supports
    (``Accelerator(log_with="tensorboard", project_dir=...)``, W&B, ...,
    or :class:`hookloop.trackers.JSONLinesTracker`) — and, with
    ``console=True``, to one printed line. Only the main process writes.

    ``every`` is not 1 by default: reading a loss value synchronises a GPU.
    If the accelerator has trackers configured but not started, this plugin
    starts them (``init_trackers(project_name, config)``) and ends them at
    the end of the fit.
    """

    name = "logger"

    def __init__(self, every=50, console=True, project_name="hookloop", config=None):
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"Logger: every must be a positive int, got {every!r}")
        self.every = every
        self.console = console
        self.project_name = project_name
        self.config = config
        self._started_trackers = False

    @hookimpl
    def on_fit_start(self, loop):
        accelerator = loop.accelerator
        if accelerator.log_with and not accelerator.trackers:
            accelerator.init_trackers(self.project_name, config=self.config)
            self._started_trackers = True

    @hookimpl
    def after_step(self, loop, loss):
        step = loop.state.global_step
        if step % self.every or not loop.accelerator.sync_gradients:
            return  # (not after a micro-batch that completed no update)
        accelerator = loop.accelerator
        losses = loss.items() if isinstance(loss, Mapping) else [(None, loss)]
        values = {}
        for name, value in losses:
            value = value.detach()
            if accelerator.num_processes > 1:  # a collective: every rank is here
                value = accelerator.reduce(value, reduction="mean")
            values["loss" if name is None else f"loss/{name}"] = value.item()
        for name, network in loop.networks.items():
            suffix = "" if len(loop.networks) == 1 else f"/{name}"
            if network.optimizer is not None:
                values["lr" + suffix] = network.optimizer.param_groups[0]["lr"]
            if network.grad_norm is not None:
                values["grad_norm" + suffix] = float(network.grad_norm)
        accelerator.log(values, step=step)
        if self.console:
            loop.print(f"step {step} " + " ".join(f"{k} {_fmt(v)}" for k, v in values.items()))

    @hookimpl
    def on_epoch_end(self, loop, epoch, metrics):
        if not metrics:
            return
        loop.accelerator.log({**metrics, "epoch": epoch}, step=loop.state.global_step)
        if self.console:
            loop.print(f"epoch {epoch} " + " ".join(f"{k} {_fmt(v)}" for k, v in metrics.items()))

    @hookimpl
    def on_fit_end(self, loop):
        self._end(loop)

    @hookimpl
    def on_exception(self, loop, exception):
        self._end(loop)

    def _end(self, loop):
        if self._started_trackers:
            # not accelerator.end_training(): it also destroys the process
            # group, and a later evaluate() or fit() in several processes
            # then fails at its first collective
            for tracker in loop.accelerator.trackers:
                tracker.finish()
            self._started_trackers = False


def _fmt(value):
    return f"{value:.4g}" if isinstance(value, float) else str(value)
