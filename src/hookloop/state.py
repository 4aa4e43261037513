"""Where the loop is: the part of a run that must survive a restart."""

from dataclasses import asdict, dataclass, fields


@dataclass
class LoopState:
    """The loop's position and flags, readable (and, for the flags, writable
    through :meth:`Loop.stop` / :meth:`Loop.skip_batch`) by every plugin.

    ``state_dict`` is plain data (ints, strings) so that checkpoints store it
    as JSON, not as a pickle.
    """

    #: the current epoch, counted from 0
    epoch: int = 0
    #: batches drawn from ``train_data`` in the current epoch (skipped ones
    #: included): the data position a resume continues from
    step_in_epoch: int = 0
    #: training steps done over the whole run (skipped batches excluded);
    #: ``fit(max_steps=N)`` stops when it reaches N
    global_step: int = 0
    #: epochs or steps the current ``fit`` was asked for (None: not limited)
    max_epochs: int | None = None
    max_steps: int | None = None
    #: set by :meth:`Loop.stop`: the loop ends after the current step
    should_stop: bool = False
    stop_reason: str | None = None
    #: set by :meth:`Loop.skip_batch` in ``before_step``; reset every batch
    skip_batch: bool = False

    # the flags are per-run decisions, not position: not checkpointed
    _TRANSIENT = ("should_stop", "stop_reason", "skip_batch", "max_epochs", "max_steps")

    def state_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in self._TRANSIENT}

    def load_state_dict(self, state: dict) -> None:
        known = {f.name for f in fields(self)}
        for key, value in state.items():
            if key not in known:
                raise KeyError(f"unknown LoopState field {key!r} in checkpoint")
            setattr(self, key, value)
