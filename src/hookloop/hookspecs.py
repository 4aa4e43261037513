"""The hook reference: every point of the training loop where a plugin can act.

Each hook is one documented function, in the order the loop calls it. A plugin
implements a hook by defining a method of the same name marked ``@hookimpl``;
it may take any subset of the hook's arguments, by name. The annotations say
what each argument is; ``loop`` is a :class:`hookloop.Loop` (annotated with
its plugin-facing protocol, :class:`hookloop.protocols.LoopLike`).

Call order for one epoch of supervised training with an evaluation set::

    on_loop_start                                       once, in Loop(...)
    on_fit_start
      (sanity check: on_eval_start, eval_step + after_eval_step on one eval batch,
       on_eval_end; loop.state.stage == "sanity", metrics go nowhere)
      on_epoch_start
        before_step                                   ┐
        training_step                                 │ once per batch
          compute_loss                                │
          before_backward / after_backward            │ once per network
          commit_update                               │ (update steps only; False: discarded)
          before_optimizer_step / after_optimizer_step│ (update steps only)
          before_scheduler_step / after_scheduler_step│ (update steps only)
          before_zero_grad / after_zero_grad          │ (update steps only)
        after_step                                    ┘
        (every eval_every updates: on_eval_start ... on_eval_end)
        on_safe_point(epoch_end=False)                  after every update (not one a stop ends at)
      on_train_epoch_end                                also after a stop / max_steps
        on_eval_start
          eval_step                                     ┐ once per eval batch
          after_eval_step                               ┘
        on_eval_end
      on_epoch_end
      on_safe_point(epoch_end=True)                     fit_end=True after the fit's last epoch
    on_fit_end
    on_loop_end                                         once, in loop.close()

``on_exception`` replaces the rest of this sequence when anything raises.

``loop.find_lr()`` (:mod:`hookloop.lr_finder`) calls ``before_step``,
``training_step`` and the hooks inside it, and no other hook, outside any
fit (``loop.state.stage == "find_lr"``; maybe before the first
``on_fit_start``), for every plugin but those that declare
``changes_training = False``; then it puts the run back as it was.

**How a fit or an epoch ends, and which hooks run** (as Ignite's ``Events``
documents ``terminate``). "Epoch end" is ``on_train_epoch_end``, the
evaluation (with ``eval_data``), ``on_epoch_end`` and the epoch's
``on_safe_point``; ``loop.state.epoch_end_reason`` names the way it ended
from ``on_train_epoch_end`` to that safe point.

==============================  ===========================================================
the epoch or fit ends by        what runs
==============================  ===========================================================
its data running out            the epoch end (``"data"``; ``epoch_complete``): the next
                                epoch follows, or ``on_fit_end`` when ``epochs`` is reached
:meth:`Loop.end_epoch`          at the next update boundary: the epoch end (``"end_epoch"``;
                                ``epoch_complete``, as if its data ran out); the next
                                epoch starts with its first batch
:meth:`Loop.stop`               at the next update boundary (after its evaluation when
                                asked during one): the epoch end (``"stop"``; not
                                complete: the next fit continues the epoch), then
                                ``on_fit_end``; the stop is in the checkpoint
``fit(max_steps=N)``            at update N: as a stop (``"max_steps"``)
:meth:`Loop.skip_batch`         no ``training_step`` / ``after_step`` for that batch, no
                                safe point (no update); the position still advances
a continued epoch with nothing  (a stop at the last batch of a stream without a length)
left                            nothing: the epoch had ended; the next one starts
an exception                    ``on_exception``, then it propagates: no epoch end, no
                                ``on_fit_end``, no safe point (a checkpoint written before
                                is what a resume continues)
preemption (SIGTERM / SIGINT    the ``Checkpoint`` plugin saves at the next safe point
with ``Checkpoint``)            and raises :class:`~hookloop.preemption.Preempted`:
                                ``on_exception``, exit status 75; no ``on_fit_end``
``fit`` on a finished run       ``on_fit_start``, ``on_fit_end`` (no sanity check, no
(its limits reached, or         epoch; a warning); ``fit`` returns the last metrics. A run
resumed where a stop ended it)  resumed where a stop ended its fit is that fit, stopped: the
                                next ``fit`` trains on
==============================  ===========================================================

An evaluation at an update that ``eval_every`` already evaluated is not run
again at that update's epoch end: ``on_epoch_end`` gets its metrics.

**Steps are optimizer updates.** ``loop.state.global_step`` counts completed
updates (one per accumulation group under ``gradient_accumulation_steps=k``;
the GAN strategy's batch is one update of each network);
``loop.state.micro_step`` counts trained batches. Inside the hooks:

========================================  ==========================================
hook                                      ``global_step`` holds
========================================  ==========================================
``before_step``, ``training_step`` and     the updates before this batch's: the
every per-network hook inside it           optimizer-step hooks see the update
(``compute_loss`` ... ``after_zero_grad``) being made, not yet counted
``after_step``                            this batch's update counted (if the batch
                                          completed one: ``loop.accelerator.sync_gradients``)
``on_train_epoch_end``, evaluation hooks,  every update of the epoch so far
``on_epoch_end``, ``on_fit_end``
========================================  ==========================================

``micro_step`` follows the same rule for batches (``after_step``: this batch
counted). A stop (:meth:`Loop.stop`, ``max_steps``) takes effect at the next
update boundary and still ends the epoch: ``on_train_epoch_end``, evaluation,
``on_epoch_end``.

Hooks marked *firstresult* stop at the first implementation that returns a
value other than ``None``; for every other hook the return value is ignored.
Implementations run in the order the plugins were given (``plugins=[A, B]``:
A first), user plugins before installed ones before built-in ones, and
``tryfirst`` / ``trylast`` move an implementation to the front or the back
(several ``trylast`` ones run in pluggy's order: the first registered, the
last of ``plugins=[...]``, first). A built-in default of a *firstresult* hook
(the strategy's ``training_step`` and ``eval_step``, the default loss) runs
after every plugin's implementation, ``trylast`` ones included: it answers
only when no plugin does, and a wrapper of the hook gets its result.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .markers import hookspec

if TYPE_CHECKING:  # names for the annotations only: nothing more is imported at run time
    from pathlib import Path

    from torch import Tensor

    from .network import Network
    from .protocols import LoopLike  # not Loop: see hookloop.protocols
    from .strategies.base import StepOutput

# -- fit: the whole run ------------------------------------------------------


@hookspec
def on_loop_start(loop: LoopLike) -> None:
    """Called once by ``Loop(...)`` when its plugins are registered, before
    it prepares the networks and data or restores ``resume_from``.

    The place for what must hold for the loop's whole life, not one fit:
    the ``preemption`` plugin installs its signal handlers here, so that a
    preemption during start-up, ``load_checkpoint``, or an ``evaluate`` /
    ``predict`` after ``fit`` also ends with status 75. Nothing is prepared
    yet: ``loop.networks`` hold the user's objects.

    :param loop: the :class:`~hookloop.Loop` being built.

    Return value ignored.

    .. versionadded:: 0.3
    """


@hookspec
def on_loop_end(loop: LoopLike) -> None:
    """Called once when :meth:`Loop.close` releases the loop (also for every
    loop still open at interpreter exit): undo what ``on_loop_start`` did.

    :param loop: the :class:`~hookloop.Loop`.

    Return value ignored.

    .. versionadded:: 0.3
    """


@hookspec
def on_fit_start(loop: LoopLike) -> None:
    """Called once at the start of :meth:`Loop.fit`, before the first epoch.

    Set up here: initialise trackers, open files (main process only), read
    options that depend on the run length (``loop.state.max_steps``).

    :param loop: the :class:`~hookloop.Loop`; ``loop.state`` holds the
        position the run starts from (not zero after a resume).

    Return value ignored.

    .. versionadded:: 0.1
    """


@hookspec
def on_fit_end(loop: LoopLike) -> None:
    """Called once when :meth:`Loop.fit` finishes normally: all epochs or
    ``max_steps`` done, or a plugin called :meth:`Loop.stop`.

    Flush and close here: trackers, progress bars, files.

    :param loop: the :class:`~hookloop.Loop`.

    Return value ignored.

    .. versionadded:: 0.1
    """


@hookspec
def on_exception(loop: LoopLike, exception: BaseException) -> None:
    """Called when anything raises inside :meth:`Loop.fit` or
    :meth:`Loop.evaluate`: a plugin, the model, the data.

    Clean up here (close progress bars and trackers, write an emergency
    checkpoint). The loop re-raises the exception afterwards; an
    implementation cannot swallow it. ``on_fit_end`` is not called.

    :param loop: the :class:`~hookloop.Loop`.
    :param exception: the exception that was raised (``KeyboardInterrupt``
        included).

    Return value ignored.

    .. versionadded:: 0.1
    """


# -- epoch -------------------------------------------------------------------


@hookspec
def on_epoch_start(loop: LoopLike, epoch: int) -> None:
    """Called at the start of every training epoch, before its first batch.

    :param loop: the :class:`~hookloop.Loop`.
    :param epoch: the epoch about to run, counted from 0.

    Return value ignored.

    .. versionadded:: 0.1
    """


@hookspec
def on_train_epoch_end(loop: LoopLike, epoch: int) -> None:
    """Called after the last training batch of an epoch, before its
    evaluation: when the data ran out, and also when a stop or ``max_steps``
    ended the epoch early (``loop.state.epoch_complete`` tells which).

    The place to close what ``on_epoch_start`` opened around training only
    (a profiler, LocalSGD, peak-memory tracking), before evaluation runs.

    :param loop: the :class:`~hookloop.Loop`.
    :param epoch: the epoch whose training just ended, counted from 0.

    Return value ignored.

    .. versionadded:: 0.2
    """


@hookspec
def on_epoch_end(loop: LoopLike, epoch: int, metrics: dict[str, float]) -> None:
    """Called at the end of every epoch, after its evaluation; also when a
    stop or ``max_steps`` ended the epoch early (then
    ``loop.state.epoch_complete`` is False and the next ``fit`` continues
    this epoch).

    The place for epoch logging, checkpoints and early stopping
    (:meth:`Loop.stop`). ``fit()`` returns the ``metrics`` of its last
    epoch.

    :param loop: the :class:`~hookloop.Loop`.
    :param epoch: the epoch that just ended, counted from 0.
    :param metrics: a dict of floats: the evaluation metrics of this epoch
        (``{}`` without ``eval_data``). Implementations may add entries;
        later implementations see them.

    Return value ignored.

    .. versionadded:: 0.1
    .. versionchanged:: 0.2
        Also called when a stop or ``max_steps`` ends the epoch early.
    """


@hookspec
def on_safe_point(loop: LoopLike, epoch_end: bool, fit_end: bool) -> None:
    """Called where a checkpoint written now resumes exactly: dying right
    after it and resuming does what the uninterrupted run does next.

    That is after every update (once its ``after_step`` hooks and its
    ``eval_every`` evaluation ran, with the random states put back as
    training continues from them), and after every epoch end (after
    ``on_epoch_end``, with the position already at the next epoch's start
    when the epoch is over). An update at which a stop, ``end_epoch`` or
    ``max_steps`` ends the epoch has no safe point of its own: the epoch
    end is part of it, and its safe point follows. At the safe point of an
    epoch's last update (the loop knows it when the data has a length or
    was prepared by Accelerate) ``loop.state.epoch_end_reason`` is already
    ``"data"``. The built-in ``Checkpoint`` plugin saves here (``trylast``);
    saves asked for elsewhere (a monitored metric in ``on_eval_end``,
    ``Checkpoint.save()`` from any hook) wait for the next one, so that a
    step checkpoint and a monitor checkpoint of one update are one
    checkpoint. :attr:`Loop.at_safe_point` is true meanwhile. Not called
    after skipped batches, inside accumulation groups, or when an exception
    ends the fit.

    :param loop: the :class:`~hookloop.Loop`; ``loop.state`` is what a
        checkpoint records (after an epoch end that is over: ``epoch`` is
        the next one, ``step_in_epoch`` 0; ``epoch_end_reason`` says why
        it ended).
    :param epoch_end: True after an epoch end, False after an update.
    :param fit_end: True at the fit's last safe point (after the epoch end
        that finishes it); ``on_fit_end`` follows.

    Return value ignored.

    .. versionadded:: 0.3
    """


# -- checkpoints --------------------------------------------------------------


@hookspec
def before_save_checkpoint(loop: LoopLike, checkpoint: Path, reason: str) -> None:
    """Called by a ``Checkpoint`` plugin before it writes a checkpoint (at a
    safe point, or outside a fit), on every process. Raise to refuse it: the
    built-in ``FiniteCheck`` raises ``NonFiniteLoss`` for a run whose loss
    went NaN, so that no checkpoint of a poisoned run is published.

    :param loop: the :class:`~hookloop.Loop`, at the position the checkpoint records.
    :param checkpoint: where it will be written (a later generation of the
        name if that one is taken: see ``after_save_checkpoint``).
    :param reason: why (``"every_steps"``, ``"epoch_end"``, ``"monitor"``,
        ``"fit_end"``, ``"preempted"``, ``"requested"`` ...).

    Return value ignored.

    .. versionadded:: 0.4
    """


@hookspec
def after_save_checkpoint(loop: LoopLike, checkpoint: Path, reason: str) -> None:
    """Called on every process when a checkpoint a ``Checkpoint`` plugin
    wrote is published (``latest`` names it): at once for a synchronous
    save, at a later safe point (or the fit's end) for an asynchronous one.
    Report it to an experiment tracker or a job scheduler here.

    :param loop: the :class:`~hookloop.Loop`.
    :param checkpoint: its directory.
    :param reason: why it was written (as in ``before_save_checkpoint``).

    Return value ignored.

    .. versionadded:: 0.4
    """


@hookspec
def after_load_checkpoint(loop: LoopLike, checkpoint: Path, manifest: dict[str, Any] | None) -> None:
    """Called once a checkpoint is restored (``Loop(resume_from=...)``,
    ``loop.load_checkpoint``; not ``weights_only=True``), after the plugin
    states, on every process.

    :param loop: the :class:`~hookloop.Loop`, restored.
    :param checkpoint: its directory.
    :param manifest: its ``hookloop.json``, as read (once) and verified;
        None for a folder of ``accelerator.save_state``.

    Return value ignored.

    .. versionadded:: 0.4
    """


@hookspec
def first_nonfinite_update(loop: LoopLike, after: int) -> tuple[int, str, str] | None:
    """Called when a checkpoint is refused because a network's state is not
    finite, to say when it went bad: the built-in ``GradClip`` answers from
    the gradient norms it keeps (no device sync per step). The earliest
    answer is named in the refusal.

    :param loop: the :class:`~hookloop.Loop`.
    :param after: the update of the last finite checkpoint: look after it.
    :return: ``(update, network, what)`` of the first update after ``after``
        whose values a plugin saw go NaN or infinite, or None.

    .. versionadded:: 0.4
    """


# -- step: one batch ---------------------------------------------------------


@hookspec
def before_step(loop: LoopLike, batch: Any) -> None:
    """Called for every training batch, before the strategy sees it.

    Inspect the batch or change it in place (a mapping's entries, a list's
    items); call :meth:`Loop.skip_batch` to drop it (no ``training_step``, no
    ``after_step``; the data position still advances).

    :param loop: the :class:`~hookloop.Loop`; ``loop.state.step_in_epoch`` is
        the index of this batch in the epoch; ``global_step`` and
        ``micro_step`` do not count this batch yet.
    :param batch: the batch as the prepared dataloader yields it, already on
        the device.

    Return value ignored.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def training_step(loop: LoopLike, batch: Any) -> StepOutput | None:
    """Do everything one batch does: forward, loss, backward, optimizer steps.

    This is the *strategy* hook. The built-in supervised strategy (one network
    named ``"model"``), :class:`hookloop.strategies.GAN` (two networks) and
    :class:`hookloop.strategies.Distillation` (a frozen teacher, a student)
    implement it; the strategy's runs after every plugin's implementation
    (``trylast`` ones too), so a user plugin that returns a result replaces
    it. A strategy calls the per-network hooks (``compute_loss``,
    ``before_backward`` ... ``after_zero_grad``) through the functions of
    :mod:`hookloop.strategy` (``loss_and_backward``, ``update``), the kit to
    write one.

    :param loop: the :class:`~hookloop.Loop`.
    :param batch: the training batch (after ``before_step``).
    :return: a :class:`hookloop.StepOutput` ``(outputs, loss)``; ``loss`` is a
        tensor, or a dict of tensors keyed by network name.

    Stops at the first non-None result.

    .. versionadded:: 0.1
    """


@hookspec
def after_step(loop: LoopLike, batch: Any, outputs: Any, loss: Tensor | dict[str, Tensor]) -> None:
    """Called after every trained batch (not after skipped ones), under
    gradient accumulation after every micro-batch:
    ``loop.accelerator.sync_gradients`` is true after the batch that
    completed an update.

    The place for logging and metrics. Calling ``loss.item()`` synchronises a
    GPU: do it every N updates, not on every step.

    :param loop: the :class:`~hookloop.Loop`; ``loop.state.micro_step``
        counts this batch, ``loop.state.global_step`` this batch's update if
        it completed one.
    :param batch: the training batch.
    :param outputs: what the strategy's forward pass returned (for the GAN
        strategy a dict keyed by network name).
    :param loss: the loss tensor ``compute_loss`` returned (its graph already
        freed by the backward pass); for several networks a dict keyed by
        network name.

    Return value ignored.

    .. versionadded:: 0.1
    .. versionchanged:: 0.2
        ``global_step`` counts optimizer updates, not batches.
    """


# -- per network, inside training_step ---------------------------------------


@hookspec(firstresult=True)
def compute_loss(loop: LoopLike, network: Network, batch: Any, outputs: Any) -> Tensor | None:
    """Return the loss to minimise for ``network`` on this batch.

    Called by the strategy once per network per batch. The built-in default
    (plugin ``"loss"``, run after every plugin's implementation, ``trylast``
    ones too) returns ``outputs.loss`` when the model computed one, else
    the cross-entropy of the logits against the batch's targets; the GAN
    strategy's default is the non-saturating BCE-with-logits loss for
    ``network.name`` ``"generator"`` and ``"discriminator"``; the
    distillation strategy's, for ``"student"``, the temperature-scaled KL to
    the teacher plus the hard-label cross-entropy. Return ``None`` to leave
    the decision to the next implementation (for another network). A result
    that is not a scalar tensor with a graph raises an error naming the
    plugin that returned it.

    Training only: evaluation does not call it, and ``eval_loss`` stays the
    default metrics' (the cross-entropy, or the model's own ``outputs.loss``).
    A plugin whose loss should be the one evaluated also returns its
    per-example values as ``eval_loss`` from ``after_eval_step`` and declares
    ``replaces = ("metrics",)`` (docs/plugins.md shows one).

    :param loop: the :class:`~hookloop.Loop`.
    :param network: the :class:`~hookloop.Network` being trained
        (``network.name``, ``network.model`` ...).
    :param batch: the training batch.
    :param outputs: the network's forward output for this batch. For the
        GAN strategy a dict: the discriminator's logits on real and fake
        samples and the samples themselves (see
        :mod:`hookloop.strategies.gan` for the keys of each network); for the
        distillation strategy ``{"student": ..., "teacher": ...}``, both
        networks' outputs (the teacher's without a graph).
    :return: a scalar tensor.

    Stops at the first non-None result.

    .. versionadded:: 0.1
    """


@hookspec
def before_backward(loop: LoopLike, network: Network, loss: Tensor) -> None:
    """Called before ``accelerator.backward(loss)`` for ``network``.

    :param loop: the :class:`~hookloop.Loop`.
    :param network: the :class:`~hookloop.Network` whose loss is about to be
        back-propagated.
    :param loss: the loss tensor returned by ``compute_loss``.

    Return value ignored.

    .. versionadded:: 0.1
    """


@hookspec
def after_backward(loop: LoopLike, network: Network) -> None:
    """Called once per batch for every network that is updated, when its
    gradients are in ``.grad``: right after ``accelerator.backward(loss)``
    for the network whose loss it was (the kit's ``loss_and_backward``), and,
    for a network whose gradients another network's loss filled (an encoder
    under its decoder's loss, one backward for both) or the kit's bare
    ``backward``, at the start of its ``update``, before ``commit_update``
    and its optimizer step.

    The place for gradient clipping and inspection. Under gradient
    accumulation this runs on every micro-batch; gradients are complete (and
    synchronised across processes) only where
    ``loop.accelerator.sync_gradients`` is true.

    :param loop: the :class:`~hookloop.Loop`.
    :param network: the :class:`~hookloop.Network` whose gradients are there.

    Return value ignored.

    .. versionadded:: 0.1
    .. versionchanged:: 0.5
       also for a network updated without a ``loss_and_backward`` of its own.
    """


@hookspec
def commit_update(loop: LoopLike, network: Network) -> bool | None:
    """Called at an update (gradients synchronised), after ``network``'s
    backward pass and its ``after_backward`` hooks, before its optimizer
    steps: return ``False`` to discard this update of ``network``.

    A discarded update steps neither the optimizer nor the scheduler (the
    gradients are zeroed, between ``before_zero_grad`` and
    ``after_zero_grad``); its batch is consumed, not drawn again; and a
    batch in which any network's update was discarded is not counted:
    ``loop.state.global_step`` counts committed updates, there is no safe
    point after it, and ``loop.discarded_updates`` counts it. This is
    where per-step fault tolerance decides (``hookloop-torchft`` returns
    torchft's ``Manager.should_commit()``). ``None`` or ``True``: commit.
    Unimplemented, it costs nothing.

    :param loop: the :class:`~hookloop.Loop`.
    :param network: the :class:`~hookloop.Network` about to be updated.
    :return: ``False`` to discard the update; ``None`` (or ``True``) to commit it.

    .. versionadded:: 0.4
    """


@hookspec
def before_optimizer_step(loop: LoopLike, network: Network) -> None:
    """Called just before ``network.optimizer.step()``, on steps where
    gradients are synchronised (every step without accumulation).

    :param loop: the :class:`~hookloop.Loop`.
    :param network: the :class:`~hookloop.Network` about to be updated.

    Return value ignored.

    .. versionadded:: 0.1
    """


@hookspec
def after_optimizer_step(loop: LoopLike, network: Network) -> None:
    """Called just after ``network.optimizer.step()``, on steps where
    gradients are synchronised: the parameters are updated, the gradients
    not yet zeroed.

    :param loop: the :class:`~hookloop.Loop`.
    :param network: the :class:`~hookloop.Network` that was updated.

    Return value ignored.

    .. versionadded:: 0.1
    """


@hookspec
def before_scheduler_step(loop: LoopLike, network: Network) -> None:
    """Called just before ``network.scheduler.step()``, on synchronised
    steps, for networks that have a scheduler.

    :param loop: the :class:`~hookloop.Loop`.
    :param network: the :class:`~hookloop.Network` whose scheduler steps.

    Return value ignored.

    .. versionadded:: 0.1
    """


@hookspec
def after_scheduler_step(loop: LoopLike, network: Network) -> None:
    """Called just after ``network.scheduler.step()``, on synchronised steps,
    for networks that have a scheduler.

    :param loop: the :class:`~hookloop.Loop`.
    :param network: the :class:`~hookloop.Network` whose scheduler stepped.

    Return value ignored.

    .. versionadded:: 0.1
    """


@hookspec
def before_zero_grad(loop: LoopLike, network: Network) -> None:
    """Called just before ``network.optimizer.zero_grad()``, on synchronised
    steps: the last chance to read this step's gradients.

    :param loop: the :class:`~hookloop.Loop`.
    :param network: the :class:`~hookloop.Network` whose gradients are about
        to be cleared.

    Return value ignored.

    .. versionadded:: 0.1
    """


@hookspec
def after_zero_grad(loop: LoopLike, network: Network) -> None:
    """Called just after ``network.optimizer.zero_grad()``, on synchronised
    steps.

    :param loop: the :class:`~hookloop.Loop`.
    :param network: the :class:`~hookloop.Network` whose gradients were
        cleared.

    Return value ignored.

    .. versionadded:: 0.1
    """


# -- evaluation --------------------------------------------------------------


@hookspec
def on_eval_start(loop: LoopLike) -> None:
    """Called at the start of every evaluation, after the networks were put
    in eval mode: at the end of every epoch when the loop has ``eval_data``,
    every ``eval_every`` updates, for :meth:`Loop.evaluate`, and for the
    sanity check before training (an evaluation of one batch, with
    ``loop.state.stage == "sanity"``, whose metrics go nowhere).

    A metric plugin resets what it accumulates here; a plugin that acts on
    an evaluation's result (saving the best, stopping early, reporting)
    ignores the sanity check's, or uses it to check that the metric it
    needs exists.

    :param loop: the :class:`~hookloop.Loop`.

    Return value ignored.

    .. versionadded:: 0.1
    .. versionchanged:: 0.3
        Also for the sanity check (``loop.state.stage == "sanity"``).
    """


@hookspec(firstresult=True)
def eval_step(loop: LoopLike, batch: Any, eval_set: str | None) -> Any:
    """Run the forward pass of one evaluation batch, under
    ``torch.no_grad()``, and return its outputs.

    This is the strategy's evaluation hook: one forward per batch, whose
    outputs every ``after_eval_step`` implementation then receives. The
    built-in supervised strategy's, run after every plugin's implementation,
    returns ``model(**batch)`` / ``model(inputs)`` as the training step calls it.
    :meth:`Loop.predict` gathers these outputs.

    :param loop: the :class:`~hookloop.Loop`; ``loop.state.stage`` is
        ``"eval"``, ``"sanity"`` or ``"predict"``.
    :param batch: the evaluation batch, on the device.
    :param eval_set: the name of the evaluation set the batch is of
        (``Loop(eval_data={"val": ..., "test": ...})``), None for the one set
        of ``eval_data`` (or for :meth:`Loop.predict`).
    :return: the model's outputs for the batch (anything but ``None``).

    Stops at the first non-None result.

    .. versionadded:: 0.1
    .. versionchanged:: 0.2
        Returns the forward outputs; metrics moved to ``after_eval_step``.
    .. versionchanged:: 0.5
        ``eval_set``.
    """


@hookspec
def after_eval_step(loop: LoopLike, batch: Any, outputs: Any, eval_set: str | None) -> Mapping[str, Tensor] | None:
    """Called for every implementation after each evaluation batch, with
    the outputs ``eval_step`` returned: the place for metrics.

    Two ways to compute a metric, both exact over several processes:

    - return ``{name: per-example tensor}`` passed through
      ``loop.accelerator.gather_for_metrics`` (every example once over all
      processes); the loop averages each name over the evaluation set into
      ``metrics`` (the built-in ``metrics`` plugin returns ``eval_loss`` and
      ``eval_accuracy`` this way);
    - or accumulate in the plugin (reset in ``on_eval_start``) and write the
      result into ``metrics`` in ``on_eval_end``.

    Several evaluation sets (``eval_data={"val": ..., "test": ...}``) are one
    evaluation: the values returned for the batches of set ``test`` become
    ``eval_test_loss`` ...; a plugin that accumulates keeps one result per
    ``eval_set`` and writes each under its name
    (``hookloop.evaluation.metric_key(eval_set, "eval_f1")``).

    :param loop: the :class:`~hookloop.Loop`.
    :param batch: the evaluation batch, on the device.
    :param outputs: what ``eval_step`` returned for it.
    :param eval_set: the name of the batch's evaluation set, None for the one
        set of ``eval_data``.
    :return: ``None``, or a dict of per-example tensors (gathered).

    .. versionadded:: 0.2
    .. versionchanged:: 0.5
        ``eval_set``.
    """


@hookspec
def on_eval_end(loop: LoopLike, metrics: dict[str, float]) -> None:
    """Called at the end of every evaluation, before the networks go back
    to train mode.

    :param loop: the :class:`~hookloop.Loop`.
    :param metrics: a dict of floats, each metric averaged over every
        evaluation example (same on every process). Implementations may add
        entries; later implementations and the caller see them. With
        several evaluation sets, each set's metrics under its own keys
        (``eval_val_loss``, ``eval_test_loss``: ``metrics.eval_sets`` names
        the sets); an ``eval_*`` key written without a set's name is then an
        error naming the plugin (it would mix the sets).

    Return value ignored.

    .. versionadded:: 0.1
    """
