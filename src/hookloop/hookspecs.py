"""The hook reference: every point of the training loop where a plugin can act.

Each hook is one documented function, in the order the loop calls it. A plugin
implements a hook by defining a method of the same name marked ``@hookimpl``;
it may take any subset of the hook's arguments, by name.

Call order for one epoch of supervised training with an evaluation set::

    on_fit_start
      on_epoch_start
        before_step                                   ┐
        training_step                                 │ once per batch
          compute_loss                                │
          before_backward / after_backward            │ once per network
          before_optimizer_step / after_optimizer_step│ (sync steps only)
          before_scheduler_step / after_scheduler_step│ (sync steps only)
          before_zero_grad / after_zero_grad          │ (sync steps only)
        after_step                                    ┘
        on_eval_start
          eval_step                                     once per eval batch
        on_eval_end
      on_epoch_end
    on_fit_end

``on_exception`` replaces the rest of this sequence when anything raises.

Hooks marked *firstresult* stop at the first implementation that returns a
value other than ``None``; for every other hook the return value is ignored.
Implementations run in the order the plugins were given (``plugins=[A, B]``:
A first), user plugins before installed ones before built-in ones, and
``tryfirst`` / ``trylast`` move an implementation to the front or the back.
"""

from .markers import hookspec

# ---------------------------------------------------------------------------
# fit: the whole run
# ---------------------------------------------------------------------------


@hookspec
def on_fit_start(loop):
    """Called once at the start of :meth:`Loop.fit`, before the first epoch.

    Set up here: initialise trackers, open files (main process only), read
    options that depend on the run length (``loop.state.max_steps``).

    :param loop: the :class:`~hookloop.Loop`; ``loop.state`` holds the
        position the run starts from (not zero after a resume).

    Return value ignored.

    .. versionadded:: 0.1
    """


@hookspec
def on_fit_end(loop):
    """Called once when :meth:`Loop.fit` finishes normally: all epochs or
    ``max_steps`` done, or a plugin called :meth:`Loop.stop`.

    Flush and close here: trackers, progress bars, files.

    :param loop: the :class:`~hookloop.Loop`.

    Return value ignored.

    .. versionadded:: 0.1
    """


@hookspec
def on_exception(loop, exception):
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


# ---------------------------------------------------------------------------
# epoch
# ---------------------------------------------------------------------------


@hookspec
def on_epoch_start(loop, epoch):
    """Called at the start of every training epoch, before its first batch.

    :param loop: the :class:`~hookloop.Loop`.
    :param epoch: the epoch about to run, counted from 0.

    Return value ignored.

    .. versionadded:: 0.1
    """


@hookspec
def on_epoch_end(loop, epoch, metrics):
    """Called at the end of every training epoch, after its evaluation.

    The place for epoch logging, checkpoints and early stopping
    (:meth:`Loop.stop`).

    :param loop: the :class:`~hookloop.Loop`.
    :param epoch: the epoch that just ended, counted from 0.
    :param metrics: a dict of floats: the evaluation metrics of this epoch
        (``{}`` without ``eval_data``). Implementations may add entries;
        later implementations see them.

    Return value ignored.

    .. versionadded:: 0.1
    """


# ---------------------------------------------------------------------------
# step: one batch
# ---------------------------------------------------------------------------


@hookspec
def before_step(loop, batch):
    """Called for every training batch, before the strategy sees it.

    Inspect the batch or change it in place (a mapping's entries, a list's
    items); call :meth:`Loop.skip_batch` to drop it (no ``training_step``, no
    ``after_step``; the data position still advances).

    :param loop: the :class:`~hookloop.Loop`; ``loop.state.step_in_epoch`` is
        the index of this batch in the epoch.
    :param batch: the batch as the prepared dataloader yields it, already on
        the device.

    Return value ignored.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def training_step(loop, batch):
    """Do everything one batch does: forward, loss, backward, optimizer steps.

    This is the *strategy* hook. The built-in supervised strategy (one network
    named ``"model"``) and :class:`hookloop.strategies.GAN` (two networks)
    implement it ``trylast``, so a user plugin that returns a result replaces
    them. A strategy calls the per-network hooks (``compute_loss``,
    ``before_backward`` ... ``after_zero_grad``) through ``loop.hook``.

    :param loop: the :class:`~hookloop.Loop`.
    :param batch: the training batch (after ``before_step``).
    :return: a :class:`hookloop.StepOutput` ``(outputs, loss)``; ``loss`` is a
        tensor, or a dict of tensors keyed by network name.

    Stops at the first non-None result.

    .. versionadded:: 0.1
    """


@hookspec
def after_step(loop, batch, outputs, loss):
    """Called after every trained batch (not after skipped ones).

    The place for logging and metrics. Calling ``loss.item()`` synchronises a
    GPU: do it every N steps, not on every step.

    :param loop: the :class:`~hookloop.Loop`; ``loop.state.global_step`` already
        counts this step.
    :param batch: the training batch.
    :param outputs: what the strategy's forward pass returned (for the GAN
        strategy a dict keyed by network name).
    :param loss: the loss tensor ``compute_loss`` returned (its graph already
        freed by the backward pass); for several networks a dict keyed by
        network name.

    Return value ignored.

    .. versionadded:: 0.1
    """


# ---------------------------------------------------------------------------
# per network, inside training_step
# ---------------------------------------------------------------------------


@hookspec(firstresult=True)
def compute_loss(loop, network, batch, outputs):
    """Return the loss to minimise for ``network`` on this batch.

    Called by the strategy once per network per batch. The built-in default
    (``trylast``) returns ``outputs.loss`` when the model computed one, else
    the cross-entropy of the logits against the batch's targets; the GAN
    strategy's default is the non-saturating BCE-with-logits loss for
    ``network.name`` ``"generator"`` and ``"discriminator"``. Return ``None``
    to leave the decision to the next implementation (for another network).

    :param loop: the :class:`~hookloop.Loop`.
    :param network: the :class:`~hookloop.Network` being trained
        (``network.name``, ``network.model`` ...).
    :param batch: the training batch.
    :param outputs: the network's forward output for this batch. For the
        GAN strategy a dict: the discriminator's logits on real and fake
        samples and the samples themselves (see
        :mod:`hookloop.strategies.gan` for the keys of each network).
    :return: a scalar tensor.

    Stops at the first non-None result.

    .. versionadded:: 0.1
    """


@hookspec
def before_backward(loop, network, loss):
    """Called before ``accelerator.backward(loss)`` for ``network``.

    :param loop: the :class:`~hookloop.Loop`.
    :param network: the :class:`~hookloop.Network` whose loss is about to be
        back-propagated.
    :param loss: the loss tensor returned by ``compute_loss``.

    Return value ignored.

    .. versionadded:: 0.1
    """


@hookspec
def after_backward(loop, network):
    """Called after ``accelerator.backward(loss)`` for ``network``: its
    gradients are in ``.grad``.

    The place for gradient clipping and inspection. Under gradient
    accumulation this runs on every micro-batch; gradients are complete (and
    synchronised across processes) only where
    ``loop.accelerator.sync_gradients`` is true.

    :param loop: the :class:`~hookloop.Loop`.
    :param network: the :class:`~hookloop.Network` that was back-propagated.

    Return value ignored.

    .. versionadded:: 0.1
    """


@hookspec
def before_optimizer_step(loop, network):
    """Called just before ``network.optimizer.step()``, on steps where
    gradients are synchronised (every step without accumulation).

    :param loop: the :class:`~hookloop.Loop`.
    :param network: the :class:`~hookloop.Network` about to be updated.

    Return value ignored.

    .. versionadded:: 0.1
    """


@hookspec
def after_optimizer_step(loop, network):
    """Called just after ``network.optimizer.step()``, on steps where
    gradients are synchronised: the parameters are updated, the gradients
    not yet zeroed.

    :param loop: the :class:`~hookloop.Loop`.
    :param network: the :class:`~hookloop.Network` that was updated.

    Return value ignored.

    .. versionadded:: 0.1
    """


@hookspec
def before_scheduler_step(loop, network):
    """Called just before ``network.scheduler.step()``, on synchronised
    steps, for networks that have a scheduler.

    :param loop: the :class:`~hookloop.Loop`.
    :param network: the :class:`~hookloop.Network` whose scheduler steps.

    Return value ignored.

    .. versionadded:: 0.1
    """


@hookspec
def after_scheduler_step(loop, network):
    """Called just after ``network.scheduler.step()``, on synchronised steps,
    for networks that have a scheduler.

    :param loop: the :class:`~hookloop.Loop`.
    :param network: the :class:`~hookloop.Network` whose scheduler stepped.

    Return value ignored.

    .. versionadded:: 0.1
    """


@hookspec
def before_zero_grad(loop, network):
    """Called just before ``network.optimizer.zero_grad()``, on synchronised
    steps: the last chance to read this step's gradients.

    :param loop: the :class:`~hookloop.Loop`.
    :param network: the :class:`~hookloop.Network` whose gradients are about
        to be cleared.

    Return value ignored.

    .. versionadded:: 0.1
    """


@hookspec
def after_zero_grad(loop, network):
    """Called just after ``network.optimizer.zero_grad()``, on synchronised
    steps.

    :param loop: the :class:`~hookloop.Loop`.
    :param network: the :class:`~hookloop.Network` whose gradients were
        cleared.

    Return value ignored.

    .. versionadded:: 0.1
    """


# ---------------------------------------------------------------------------
# evaluation
# ---------------------------------------------------------------------------


@hookspec
def on_eval_start(loop):
    """Called at the start of :meth:`Loop.evaluate` (also at the end of every
    epoch when the loop has ``eval_data``), after the networks were put in
    eval mode.

    :param loop: the :class:`~hookloop.Loop`.

    Return value ignored.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def eval_step(loop, batch):
    """Evaluate one batch of ``eval_data``, under ``torch.no_grad()``.

    The built-in supervised implementation (``trylast``) returns per-example
    ``eval_loss`` and ``eval_accuracy``. Implementations must pass what they
    return through ``loop.accelerator.gather_for_metrics`` so that every
    example is counted exactly once over all processes.

    :param loop: the :class:`~hookloop.Loop`.
    :param batch: the evaluation batch, on the device.
    :return: a dict ``{metric name: tensor of per-example values}``,
        gathered; the loop averages each over the whole evaluation set.

    Stops at the first non-None result.

    .. versionadded:: 0.1
    """


@hookspec
def on_eval_end(loop, metrics):
    """Called at the end of :meth:`Loop.evaluate`, before the networks go
    back to train mode.

    :param loop: the :class:`~hookloop.Loop`.
    :param metrics: a dict of floats, each metric averaged over every
        evaluation example (same on every process). Implementations may add
        entries; later implementations and the caller see them.

    Return value ignored.

    .. versionadded:: 0.1
    """
