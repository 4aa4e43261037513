"""What the processes of a run agree on: a stop or an epoch end asked for on
some processes only.

With several processes every one must run the same collectives in the same
order (DDP's gradient all-reduce, an evaluation's gathers). A
:meth:`Loop.stop` called on rank 0 only would end the epoch there while the
others train on: every process would wait forever in a different
collective. So with several processes a request is held where it was made
and takes effect on every process at the next *agreement point*, where all
of them meet anyway: after each evaluation in a fit (``eval_every``, a
``loop.evaluate()`` from a hook, the epoch's own), at every epoch end, and
every :attr:`every` updates (one all-reduce of two ints on a CPU group,
~0.1-0.3 ms, the check preemption uses too). A decision every process took
together (a broadcast, a gathered metric) says so, ``loop.stop(reason,
every_rank=True)``, and takes effect at once. One process pays nothing: a
request takes effect at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # names for the annotations only
    from .state import LoopState


class Agreement:
    """A loop's requests held until every process agrees on them."""

    #: updates between two agreement points inside an epoch
    every = 10

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator
        #: several processes: requests wait for an agreement point
        self.several = accelerator.num_processes > 1
        self._stop: tuple[str | None] | None = None  # (reason,) asked here, not yet agreed
        self._end_epoch = False
        self._group: torch.distributed.ProcessGroup | bool | None = None

    def stop(self, state: LoopState, reason: str | None, every_rank: bool) -> None:
        if every_rank or not self.several:
            state.stop(reason)
        else:
            self._stop = (reason,)

    def end_epoch(self, state: LoopState, every_rank: bool = False) -> None:
        if every_rank or not self.several:
            state.end_epoch = True
        else:
            self._end_epoch = True

    def due(self, global_step: int) -> bool:
        return self.several and global_step % self.every == 0

    def agree(self, state: LoopState) -> None:
        """An agreement point (every process calls it here): a request made
        on any process takes effect on all. Nothing to do with one process."""
        if not self.several:
            return
        import torch.distributed as dist

        from .preemption import _cpu_group

        if self._group is None:
            self._group = _cpu_group()
        flags = torch.tensor([self._stop is not None, self._end_epoch], dtype=torch.int64)
        if self._group is not False:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
        stop, end_epoch = bool(flags[0]), bool(flags[1])
        if stop:
            from accelerate.utils import gather_object

            mine = self._stop[0] if self._stop is not None else None
            reasons = [r for r in gather_object([mine]) if r]  # every process is here
            state.stop(mine or (f"{reasons[0]} (asked on another process)" if reasons
                                else "asked on another process"))
        if end_epoch:
            state.end_epoch = True
        self._stop, self._end_epoch = None, False

    def start_fit(self) -> None:
        self._stop, self._end_epoch = None, False
