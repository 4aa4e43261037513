"""Where the loop is: the part of a run that must survive a restart."""

from dataclasses import asdict, dataclass, fields


@dataclass
class LoopState:
    """The loop's position and flags, readable (and, for the flags, writable
    through :meth:`Loop.stop` / :meth:`Loop.skip_batch`) by every plugin.

    Two counters of training progress, as in Lightning and the Hugging Face
    Trainer: ``global_step`` counts optimizer *updates*, ``micro_step``
    counts trained *batches*. Without gradient accumulation they are equal;
    with ``gradient_accumulation_steps=k`` there is one update per k batches
    (and one for the last, partial group of an epoch).

    ``state_dict`` is plain data (ints, strings) so that checkpoints store it
    as JSON, not as a pickle.
    """

    #: the current epoch, counted from 0
    epoch: int = 0
    #: batches drawn from ``train_data`` in the current epoch (skipped ones
    #: included): the data position a resume continues from
    step_in_epoch: int = 0
    #: completed optimizer updates over the whole run (under gradient
    #: accumulation one per accumulation group; in the GAN strategy one batch
    #: is one update of each network). ``fit(max_steps=N)``,
    #: ``Checkpoint(every_steps=N)``, ``Logger(every=N)`` and
    #: ``fit(eval_every=N)`` count these. See ``hookspecs.py`` for its value
    #: inside each hook.
    global_step: int = 0
    #: trained batches (micro-batches) over the whole run, skipped ones
    #: excluded: what ``global_step`` counted in hookloop 0.1
    micro_step: int = 0
    #: epochs or steps the current ``fit`` was asked for (None: not limited)
    max_epochs: int | None = None
    max_steps: int | None = None
    #: set by :meth:`Loop.stop`: the loop ends the epoch at the next update
    #: boundary (evaluation and ``on_epoch_end`` still run)
    should_stop: bool = False
    stop_reason: str | None = None
    #: set by :meth:`Loop.skip_batch` in ``before_step``; reset every batch
    skip_batch: bool = False
    #: set by :meth:`Loop.end_epoch`: the epoch ends at the next update boundary
    end_epoch: bool = False
    #: from ``on_train_epoch_end`` to ``on_epoch_end``: True when the epoch's
    #: data ran out (the next epoch follows), False when a stop or
    #: ``max_steps`` ended it early (the next ``fit`` continues this epoch)
    epoch_complete: bool = False
    #: what the loop is doing: ``"train"``, ``"eval"`` (an evaluation, at an
    #: epoch end, every ``eval_every`` updates or from :meth:`Loop.evaluate`),
    #: ``"sanity_check"`` (the one eval batch run before training), ``"predict"``,
    #: or ``None`` outside ``fit`` / ``evaluate`` / ``predict``
    stage: str | None = None

    # the flags are per-run decisions, not position: not checkpointed
    _TRANSIENT = ("should_stop", "stop_reason", "skip_batch", "end_epoch", "max_epochs", "max_steps",
                  "epoch_complete", "stage")

    def state_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in self._TRANSIENT}

    def load_state_dict(self, state: dict) -> None:
        known = {f.name for f in fields(self)}
        for key, value in state.items():
            if key not in known:
                raise KeyError(f"unknown LoopState field {key!r} in checkpoint")
            setattr(self, key, value)
        if "micro_step" not in state:  # a hookloop 0.1 checkpoint: global_step counted batches
            self.micro_step = self.global_step
