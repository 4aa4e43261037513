"""What every strategy is made of: the protocol, the result type, the loss
and backward of one network, the update of one network. Public as
:mod:`hookloop.strategy`."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch


class StepOutput(NamedTuple):
    """What ``training_step`` returns: the forward outputs and the loss (a
    tensor, or a dict of tensors keyed by network name). ``after_step``
    receives both."""

    outputs: Any
    loss: Any


#: ``StepOutput(outputs, loss)`` without the generated ``__new__``'s Python
#: frame (~2.5k instructions a step): the same tuple of the same class
_new_step_output = tuple.__new__


class Strategy:
    """What the loop asks of a strategy; subclass it, or write any object
    with the same attributes (the loop reads them, it does not check the
    class).

    A strategy is a plugin, registered under :attr:`name`. It implements
    ``training_step`` (and, to be evaluated, ``eval_step``) with
    ``@hookimpl(trylast=True)`` and calls the per-network hooks through the
    kit's functions (:func:`loss_and_backward`, :func:`update`). The loop
    registers the built-ins with a ``trylast`` implementation after the
    plugins, so the strategy's step answers only when no plugin's does
    (``trylast`` ones included).
    """

    #: the plugin name users see (``hookloop plugins``, error messages);
    #: it cannot be blocked
    name: str = "strategy"
    #: the networks the strategy trains, as keys of ``Loop(networks={...})``
    network_names: tuple[str, ...] = ()
    #: the networks the strategy uses but does not train: they may have
    #: ``optimizer=None``; the loop prepares them for evaluation (no DDP
    #: wrapper), keeps them in eval mode and never calls ``.train()`` on them.
    #: The strategy sets ``requires_grad`` on their parameters itself.
    frozen_networks: tuple[str, ...] = ()
    #: a strategy decides what a step does (``hookloop plugins`` shows this)
    changes_training = True

    def check_networks(self, networks: Mapping) -> None:
        """Called by ``Loop(...)`` with ``{name: Network}`` before anything is
        prepared: raise ``ValueError`` saying what to pass when the networks
        do not fit. Default: exactly :attr:`network_names` (in any order)."""
        expected = set(self.network_names)
        if set(networks) != expected:
            raise ValueError(
                f"the {self.name!r} strategy uses the networks "
                f"{', '.join(map(repr, self.network_names))}; got {sorted(networks)}. "
                "Pass Loop(networks={" + ", ".join(
                    f"{n!r}: Network(model, optimizer)" for n in self.network_names) + "}, ...)"
            )

    def default_plugins(self) -> list[Any]:
        """Plugins registered with the strategy, each replaceable by a user
        plugin of the same name (a default loss, default metrics); their
        ``trylast`` implementations run after every plugin's."""
        return []

    # the hooks a strategy implements, with @hookimpl(trylast=True):
    #
    # def training_step(self, loop, batch) -> StepOutput
    # def eval_step(self, loop, batch) -> the model's forward outputs


def check_loss(loss, network, loop, batch=None, outputs=None):
    """Raise unless ``loss`` (what ``compute_loss`` returned for ``network``)
    is a tensor; the error names the plugin that returned it (found by asking
    the implementations again, in order, with ``batch`` and ``outputs``) and
    what was wrong. A scalar without a graph, or a tensor of several values,
    is reported by :func:`loss_and_backward` when ``backward`` refuses it."""
    if not isinstance(loss, torch.Tensor):
        what = "nothing (every implementation returned None)" if loss is None else (
            f"{type(loss).__name__}, not a tensor")
        raise _loss_error(
            TypeError, loop, network, batch, outputs,
            f"compute_loss returned {type(loss).__name__} for network {network.name!r}",
            f"{what}: return a scalar tensor computed from the outputs (so that it has a graph)",
        )


def _loss_problem(loss) -> str | None:
    """Why ``backward`` cannot use this loss tensor, or None."""
    if loss.numel() != 1:
        return (f"a tensor of shape {tuple(loss.shape)}, not a scalar: reduce it "
                "(e.g. .mean()) before returning it")
    if not loss.requires_grad:
        return ("a tensor that does not require grad (detached, computed under "
                "torch.no_grad(), or from constants): there is nothing to back-propagate; "
                "compute it from the outputs without .detach() / .item()")
    return None


def _loss_error(kind, loop, network, batch, outputs, headline, problem):
    plugin = returning_plugin(loop, "compute_loss", loop=loop, network=network,
                              batch=batch, outputs=outputs) if batch is not None else None
    if plugin is None:
        impls = [i.plugin_name for i in loop.plugins.pm.hook.compute_loss.get_hookimpls()]
        who = f"compute_loss plugins, first called first: {', '.join(reversed(impls))}"
    else:
        who = f"plugin {plugin!r}"
    exc = kind(f"{headline} ({who}): {problem}")
    if plugin is not None:
        exc.hookloop_culprit = (plugin, "compute_loss")  # read by the plugin manager's culprit()
    return exc


def returning_plugin(loop, hook, /, **kwargs) -> str | None:
    """The name of the plugin whose implementation of the *firstresult*
    ``hook`` gives the result for these arguments: the implementations are
    called again, in the order the loop calls them (wrappers skipped), and
    the first that returns something is named. For error messages only (it
    repeats the work); None when none returns or one raises."""
    impls = getattr(loop.plugins.pm.hook, hook).get_hookimpls()
    for impl in reversed(impls):  # pluggy calls the last first
        if impl.wrapper or impl.hookwrapper:
            continue
        try:
            result = impl.function(*(kwargs[a] for a in impl.argnames))
        except Exception:  # noqa: BLE001 - only a diagnosis
            return None
        if result is not None:
            return impl.plugin_name
    return None


@contextlib.contextmanager
def frozen(module):
    """``requires_grad=False`` on the module's trainable parameters for the
    block, restored after: back-propagate through a network without giving
    it gradients (the GAN's generator step through the discriminator)."""
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


def backward(loop, loss):
    """``loop.accelerator.backward(loss)``, without the work Accelerate would
    repeat on every call for nothing (see :mod:`hookloop.accelerate_fastpath`)."""
    loop.fastpath.backward(loss)


def loss_and_backward(loop, network, batch, outputs):
    """``compute_loss`` for one network, then ``before_backward``,
    ``accelerator.backward(loss)``, ``after_backward``. Returns the loss.

    A loss that is not a tensor, not a scalar, or has no graph raises an
    error naming the plugin that returned it (checked for free: the shape
    and the graph are looked at only when ``backward`` refuses the loss)."""
    hook = loop.hook
    loss = hook.compute_loss(loop=loop, network=network, batch=batch, outputs=outputs)
    if not isinstance(loss, torch.Tensor):
        check_loss(loss, network, loop, batch, outputs)
    quiet = hook.unimplemented(_BACKWARD_HOOKS)  # by default: calls of nothing, left out
    if not quiet:
        hook.before_backward(loop=loop, network=network, loss=loss)
    try:
        loop.fastpath.backward(loss)
    except RuntimeError as exc:
        _refused(exc, loop, network, batch, outputs, loss)
    if not quiet:
        hook.after_backward(loop=loop, network=network)
    network.backward_hooked = True  # (its update does not call after_backward again)
    return loss


def _refused(exc, loop, network, batch, outputs, loss):
    """``backward`` refused ``loss``: raise the error naming the plugin that
    returned it, or ``exc`` itself when the loss looks usable."""
    problem = _loss_problem(loss)
    if problem is None:
        raise exc
    raise _loss_error(ValueError, loop, network, batch, outputs,
                      f"compute_loss returned an unusable loss for network {network.name!r}",
                      problem) from exc


def plain_steps(loop) -> bool:
    """Whether :func:`plain_step` may stand for one network's forward,
    :func:`loss_and_backward` and :func:`update`: no gradient accumulation,
    ``backward`` is ``loss.backward()`` (:mod:`hookloop.accelerate_fastpath`),
    and no plugin implements a backward or update hook. It stays so for as
    long as ``loop.hook`` and ``loop.fastpath`` are the same objects (a
    change of plugins or of accumulation replaces one of them)."""
    return (not loop.accumulating and loop.fastpath.plain_backward
            and loop.hook.unimplemented(_STEP_HOOKS))


def plain_step(loop, network, batch, forward):
    """One network's step in one frame where :func:`plain_steps` says so
    and its scheduler (if any) steps at every update: ``forward(model,
    batch)``, ``compute_loss``, ``loss.backward()``, then optimizer step,
    scheduler step and ``zero_grad``; the same calls as
    ``loss_and_backward`` and ``update`` make, in the same order. Returns
    the :class:`StepOutput`."""
    outputs = forward(network.model, batch)
    loss = loop.hook.compute_loss(loop=loop, network=network, batch=batch, outputs=outputs)
    if not isinstance(loss, torch.Tensor):
        check_loss(loss, network, loop, batch, outputs)
    try:
        loss.backward()
    except RuntimeError as exc:
        _refused(exc, loop, network, batch, outputs, loss)
    loop.fastpath.update(network.optimizer, network.scheduler)
    return _new_step_output(StepOutput, (outputs, loss))


#: the hooks around one network's update; without implementations (the
#: defaults) their calls are left out, which nobody can tell
_UPDATE_HOOKS = ("commit_update", "before_optimizer_step", "after_optimizer_step", "before_scheduler_step",
                 "after_scheduler_step", "before_zero_grad", "after_zero_grad")
_BACKWARD_HOOKS = ("before_backward", "after_backward")
_AFTER_BACKWARD = ("after_backward",)
_STEP_HOOKS = _BACKWARD_HOOKS + _UPDATE_HOOKS


def update(loop, network):
    """Optimizer step, scheduler step and ``zero_grad`` for one network, each
    between its hooks, exactly as the hand-written Accelerate loop does them.

    First, ``after_backward`` for the network if no :func:`loss_and_backward`
    of its own called it since its last update: its gradients came from
    another network's loss (an encoder under a decoder's loss, one backward
    for both) or from :func:`backward`. So every network updated gets its
    ``after_backward`` (clipping, gradient checks) once per batch, before its
    optimizer step, whichever backward filled its gradients.

    The calls run on every batch: under gradient accumulation Accelerate makes
    them no-ops until gradients are synchronised, but its scheduler wrapper
    counts them, so skipping them would change the scheduler's state. The
    hooks fire only on synchronised steps, where something actually happens.
    """
    if network.backward_hooked:
        network.backward_hooked = False
    elif not loop.hook.unimplemented(_AFTER_BACKWARD):
        # its gradients came from a backward that was not its own loss_and_backward (one loss
        # over two networks, the kit's bare backward): its after_backward is due before its update
        loop.hook.after_backward(loop=loop, network=network)
    fast = loop.fastpath  # Accelerate's step() / zero_grad() without their per-call lookups
    optimizer, scheduler = network.optimizer, network.scheduler
    if scheduler is not None and (network.scheduler_interval != "step" or network.scheduler_frequency != 1):
        scheduler = _scheduled(loop, network, fast)  # None: not at this update
    hook = loop.hook
    if not fast.sync_gradients() or hook.unimplemented(_UPDATE_HOOKS):
        fast.update(optimizer, scheduler)  # step, scheduler step, zero_grad
        return
    if False in hook.commit_update(loop=loop, network=network):  # discarded: zero_grad only
        loop.discard_update()
        scheduler = None
    else:
        hook.before_optimizer_step(loop=loop, network=network)
        fast.step(optimizer)
        hook.after_optimizer_step(loop=loop, network=network)
    if scheduler is not None:
        hook.before_scheduler_step(loop=loop, network=network)
        fast.scheduler_step(scheduler)
        hook.after_scheduler_step(loop=loop, network=network)
    hook.before_zero_grad(loop=loop, network=network)
    fast.zero_grad(optimizer)
    hook.after_zero_grad(loop=loop, network=network)


def _scheduled(loop, network, fast):
    """The scheduler to step at this batch, or None: an epoch scheduler never
    steps here (see :func:`step_epoch_schedulers`); a step scheduler of
    frequency N at every N-th update only."""
    if network.scheduler_interval == "epoch" or not fast.sync_gradients():
        return None
    return network.scheduler if (loop.state.global_step + 1) % network.scheduler_frequency == 0 else None


def step_epoch_schedulers(loop, networks, metrics) -> None:
    """At the end of a whole epoch (``loop.state.epoch`` still the one that
    ended): every ``scheduler_interval="epoch"`` scheduler whose frequency
    says so steps once, between its hooks. Once, whatever the number of
    processes: a scheduler Accelerate prepared steps once per process per
    call, so its own scheduler is stepped."""
    epoch = loop.state.epoch
    for network in networks:
        scheduler = network.scheduler
        if (scheduler is None or network.scheduler_interval != "epoch"
                or (epoch + 1) % network.scheduler_frequency):
            continue
        inner = getattr(scheduler, "scheduler", scheduler)  # AcceleratedScheduler's
        args: tuple[Any, ...] = ()
        if network.scheduler_monitor is not None:
            if network.scheduler_monitor not in metrics:
                raise KeyError(
                    f"network {network.name!r}: scheduler_monitor {network.scheduler_monitor!r} is "
                    f"not in the epoch's metrics {sorted(metrics) or '(none: is eval_data set?)'}"
                )
            args = (metrics[network.scheduler_monitor],)
        loop.hook.before_scheduler_step(loop=loop, network=network)
        inner.step(*args)
        loop.hook.after_scheduler_step(loop=loop, network=network)
