"""A tqdm progress bar on the main process."""

from collections.abc import Mapping

from tqdm.auto import tqdm

from ..markers import hookimpl


class ProgressBar:
    """One bar for the whole fit, counting optimizer updates, showing their
    rate and, every ``every`` updates, the loss (reading the loss synchronises the device, so not on
    every step).

    A built-in default. ``disable=None`` (the default) lets tqdm decide: the
    bar shows on a terminal and stays silent in a log file. Turn it off for
    good with ``ProgressBar(disable=True)`` or by blocking ``"progress"``
    (``Loop(block=["progress"])``, ``HOOKLOOP_BLOCK_PLUGINS=progress``).
    """

    name = "progress"

    def __init__(self, every=10, disable=None, leave=True):
        self.every = every
        self.disable = disable
        self.leave = leave
        self.bar = None

    @hookimpl
    def on_fit_start(self, loop):
        disable = True if not loop.accelerator.is_main_process else self.disable
        self.bar = tqdm(
            total=loop.total_steps,
            initial=loop.state.global_step,
            disable=disable,
            leave=self.leave,
            unit="step",
            dynamic_ncols=True,
        )

    @hookimpl
    def on_epoch_start(self, loop, epoch):
        if self.bar is not None:
            self.bar.set_description(f"epoch {epoch}", refresh=False)

    @hookimpl
    def after_step(self, loop, loss):
        bar = self.bar
        if bar is None or bar.disable or not loop.accelerator.sync_gradients:
            return  # one tick per optimizer update
        bar.update(1)
        if loop.state.global_step % self.every == 0:
            if isinstance(loss, Mapping):
                bar.set_postfix({k: f"{v.item():.4f}" for k, v in loss.items()}, refresh=False)
            else:
                bar.set_postfix(loss=f"{loss.item():.4f}", refresh=False)

    @hookimpl
    def on_fit_end(self, loop):
        self._close()

    @hookimpl
    def on_exception(self, loop, exception):
        self._close()

    def _close(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None
