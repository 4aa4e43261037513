"""What every strategy shares: the result type and the update of one network."""

from typing import Any, NamedTuple


class StepOutput(NamedTuple):
    """What ``training_step`` returns: the forward outputs and the loss (a
    tensor, or a dict of tensors keyed by network name)."""

    outputs: Any
    loss: Any


def check_loss(loss, network, loop):
    """A ``compute_loss`` result the strategy can back-propagate, or an error
    naming the network and the plugins that implement the hook."""
    if getattr(loss, "requires_grad", None) is None or getattr(loss, "ndim", None) is None:
        impls = [i.plugin_name for i in loop.plugins.pm.hook.compute_loss.get_hookimpls()]
        raise TypeError(
            f"compute_loss returned {type(loss).__name__} for network {network.name!r}, "
            f"not a tensor (compute_loss plugins, first called first: {', '.join(reversed(impls))})"
        )


def backward(loop, loss):
    """``loop.accelerator.backward(loss)``, without the work Accelerate would
    repeat on every call for nothing (see :mod:`hookloop.accelerate_fastpath`)."""
    loop._fastpath.backward(loss)


def update(loop, network):
    """Optimizer step, scheduler step and ``zero_grad`` for one network, each
    between its hooks, exactly as the hand-written Accelerate loop does them.

    The calls run on every batch (under gradient accumulation Accelerate makes
    them no-ops until gradients are synchronised, and its scheduler wrapper
    counts them); the hooks fire only on synchronised steps, where something
    actually happens.
    """
    hook = loop.hook
    fast = loop._fastpath  # optimizer.step() / zero_grad() without Accelerate's per-call lookups
    sync = loop.accelerator.sync_gradients
    optimizer, scheduler = network.optimizer, network.scheduler
    if sync:
        hook.before_optimizer_step(loop=loop, network=network)
    fast.step(optimizer)
    if sync:
        hook.after_optimizer_step(loop=loop, network=network)
    if scheduler is not None:
        if sync:
            hook.before_scheduler_step(loop=loop, network=network)
        scheduler.step()
        if sync:
            hook.after_scheduler_step(loop=loop, network=network)
    if sync:
        hook.before_zero_grad(loop=loop, network=network)
    fast.zero_grad(optimizer)
    if sync:
        hook.after_zero_grad(loop=loop, network=network)
