"""A tqdm progress bar on the main process."""

from collections.abc import Mapping
from typing import Any

import torch
from tqdm.auto import tqdm

from ..markers import hookimpl


class ProgressBar:
    """One bar for the whole fit, counting optimizer updates, showing their
    rate and the loss, without ever waiting for the device.

    Every ``every`` updates the loss is copied to the host asynchronously
    (``.to("cpu", non_blocking=True)``, with a CUDA event to know when it has
    arrived); the bar shows the newest copy that has arrived, so the loss it
    shows may be a few updates old. No ``.item()`` on a device tensor: the
    training pipeline never stalls for the bar.

    A built-in default. ``disable=None`` (the default) lets tqdm decide: the
    bar shows on a terminal and stays silent in a log file. Turn it off for
    good with ``ProgressBar(disable=True)`` or by blocking ``"progress"``
    (``Loop(block=["progress"])``, ``HOOKLOOP_BLOCK_PLUGINS=progress``).
    """

    name = "progress"
    changes_training = False

    def __init__(self, every: int = 10, disable: bool | None = None, leave: bool = True) -> None:
        self.every = every
        self.disable = disable
        self.leave = leave
        self.bar = None
        self._copies: list[tuple[Any, dict[str, Any]]] = []  # [(ready: event or None, {key: host tensor})], oldest first

    @hookimpl
    def on_fit_start(self, loop):
        disable = True if not loop.accelerator.is_main_process else self.disable
        self._copies = []
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
            self._show_arrived()
            losses = loss.items() if isinstance(loss, Mapping) else (("loss", loss),)
            self._copies.append(_to_host({k: v for k, v in losses if v is not None}))

    def _show_arrived(self):
        """Show the newest copy that has arrived; drop the older ones."""
        arrived = None
        while self._copies and (self._copies[0][0] is None or self._copies[0][0].query()):
            arrived = self._copies.pop(0)[1]
        if arrived:
            self.bar.set_postfix({k: f"{float(v):.4f}" for k, v in arrived.items()}, refresh=False)

    @hookimpl
    def on_fit_end(self, loop):
        self._close()

    @hookimpl
    def on_exception(self, loop, exception):
        self._close()

    def _close(self):
        self._copies = []
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _to_host(tensors: dict):
    """``(event or None, host copies)``: copies started without waiting; the
    event (CUDA) tells when they have arrived, None: already there."""
    copies = {k: v.detach().to("cpu", non_blocking=True) for k, v in tensors.items()}
    event = None
    if any(v.is_cuda for v in tensors.values()):
        event = torch.cuda.Event()
        event.record()
    return event, copies
