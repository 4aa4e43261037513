"""Change gradient accumulation by epoch, as Lightning's ``GradientAccumulationScheduler``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..markers import hookimpl

if TYPE_CHECKING:  # names for the annotations only
    from ..protocols import LoopLike


class GradientAccumulationScheduler:
    """Accumulate ``k`` batches per optimizer update from a given epoch on::

        GradientAccumulationScheduler({0: 8, 4: 4, 8: 1})

    accumulates 8 batches per update in epochs 0-3, 4 in epochs 4-7 and
    none from epoch 8 (epochs counted from 0). Epochs before the first key
    accumulate nothing (``{2: 4}`` is ``{0: 1, 2: 4}``), as in Lightning.

    It sets ``loop.accelerator.gradient_accumulation_steps`` when the fit
    starts and at every epoch start; the loop takes the new value from the
    epoch's first batch, exactly: each update averages ``k`` batches (the
    last group of an epoch may be shorter), ``global_step`` counts updates.
    An ``Accelerator(gradient_accumulation_steps=...)`` of its own is
    refused (give the value as ``{0: k}``).

    A resumed run (the same script, ``resume_from="latest"``) continues the
    schedule where it was, exactly: checkpoints record the accumulation the
    ``Loop`` was built with, not the scheduled one.

    :param scheduling: ``{epoch: batches per update}``; epochs >= 0,
        values >= 1.
    """

    name = "accumulation-scheduler"
    changes_training = True

    def __init__(self, scheduling: dict[int, int]) -> None:
        if not isinstance(scheduling, dict) or not scheduling:
            raise ValueError("GradientAccumulationScheduler: scheduling must be a non-empty dict "
                             f"{{epoch: batches per update}}, got {scheduling!r}")
        for epoch, k in scheduling.items():
            if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
                raise ValueError(f"GradientAccumulationScheduler: epoch keys must be ints >= 0, got {epoch!r}")
            if not isinstance(k, int) or isinstance(k, bool) or k < 1:
                raise ValueError(f"GradientAccumulationScheduler: epoch {epoch} has {k!r} batches per "
                                 "update: must be an int >= 1")
        self.scheduling = dict(sorted({0: 1, **scheduling}.items()))
        self._set: int | None = None  # the value this plugin last set

    def get_accumulate_grad_batches(self, epoch: int) -> int:
        """Batches per update in ``epoch``."""
        k = 1
        for start, value in self.scheduling.items():
            if start > epoch:
                break
            k = value
        return k

    @hookimpl(tryfirst=True)  # before plugins that read the accumulation at fit start
    def on_fit_start(self, loop: LoopLike) -> None:
        acc = loop.accelerator
        current = acc.gradient_accumulation_steps
        if current not in (1, self._set, self.get_accumulate_grad_batches(loop.state.epoch)):
            raise ValueError(
                f"GradientAccumulationScheduler and Accelerator(gradient_accumulation_steps={current}) "
                f"both set the accumulation: drop the accelerator's, and give it as "
                f"GradientAccumulationScheduler({{0: {current}, ...}})"
            )
        self._apply(loop, loop.state.epoch)

    @hookimpl(tryfirst=True)
    def on_epoch_start(self, loop: LoopLike, epoch: int) -> None:
        self._apply(loop, epoch)

    def _apply(self, loop: LoopLike, epoch: int) -> None:
        k = self.get_accumulate_grad_batches(epoch)
        loop.accelerator.gradient_accumulation_steps = k
        self._set = k
