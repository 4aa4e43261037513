"""The epoch's mean training loss, as the hand-written scripts report it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..markers import hookimpl

if TYPE_CHECKING:  # names for the annotations only
    from torch import Tensor

    from ..protocols import LoopLike


class TrainLoss:
    """Put the epoch's mean training loss into its metrics: ``train_loss``
    (``train_loss/<network>`` for each network of a strategy with several),
    the mean over the epoch's trained batches and over processes, through
    ``loop.log(..., on_epoch=True)``: ``on_epoch_end`` sees it, ``fit()``
    returns it, ``Checkpoint(monitor="train_loss")`` and early stopping can
    use it, and a resumed epoch reports the same value as an uninterrupted
    one.

    Not a default: it costs a tensor addition per batch (on the device, no
    sync). ``Loop(plugins=["train-loss"])`` or ``TrainLoss()``.
    """

    name = "train-loss"
    changes_training = False

    @hookimpl
    def after_step(self, loop: LoopLike, loss: Tensor | Mapping[str, Tensor]) -> None:
        if isinstance(loss, Mapping):
            values = {f"train_loss/{name}": value.detach() for name, value in loss.items()}
        else:
            values = {"train_loss": loss.detach()}
        loop.log(values, on_step=False, on_epoch=True)
