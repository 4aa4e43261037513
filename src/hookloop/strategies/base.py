"""What every strategy shares: the result type and the update of one network."""

from typing import Any, NamedTuple

import torch


class StepOutput(NamedTuple):
    """What ``training_step`` returns: the forward outputs and the loss (a
    tensor, or a dict of tensors keyed by network name)."""

    outputs: Any
    loss: Any


def check_loss(loss, network, loop):
    """A ``compute_loss`` result the strategy can back-propagate, or an error
    naming the network and the plugins that implement the hook."""
    if not isinstance(loss, torch.Tensor):
        impls = [i.plugin_name for i in loop.plugins.pm.hook.compute_loss.get_hookimpls()]
        raise TypeError(
            f"compute_loss returned {type(loss).__name__} for network {network.name!r}, "
            f"not a tensor (compute_loss plugins, first called first: {', '.join(reversed(impls))})"
        )


def backward(loop, loss):
    """``loop.accelerator.backward(loss)``, without the work Accelerate would
    repeat on every call for nothing (see :mod:`hookloop.accelerate_fastpath`)."""
    loop._fastpath.backward(loss)


def loss_and_backward(loop, network, batch, outputs):
    """``compute_loss`` for one network, checked, then back-propagated
    between ``before_backward`` and ``after_backward``. Returns the loss."""
    hook = loop.hook
    loss = hook.compute_loss(loop=loop, network=network, batch=batch, outputs=outputs)
    check_loss(loss, network, loop)
    hook.before_backward(loop=loop, network=network, loss=loss)
    loop._fastpath.backward(loss)
    hook.after_backward(loop=loop, network=network)
    return loss


def update(loop, network):
    """Optimizer step, scheduler step and ``zero_grad`` for one network, each
    between its hooks, exactly as the hand-written Accelerate loop does them.

    The calls run on every batch: under gradient accumulation Accelerate makes
    them no-ops until gradients are synchronised, but its scheduler wrapper
    counts them, so skipping them would change the scheduler's state. The
    hooks fire only on synchronised steps, where something actually happens.
    """
    fast = loop._fastpath  # optimizer.step() / zero_grad() without Accelerate's per-call lookups
    optimizer, scheduler = network.optimizer, network.scheduler
    if not loop.accelerator.sync_gradients:
        fast.step(optimizer)
        if scheduler is not None:
            scheduler.step()
        fast.zero_grad(optimizer)
        return
    hook = loop.hook
    hook.before_optimizer_step(loop=loop, network=network)
    fast.step(optimizer)
    hook.after_optimizer_step(loop=loop, network=network)
    if scheduler is not None:
        hook.before_scheduler_step(loop=loop, network=network)
        scheduler.step()
        hook.after_scheduler_step(loop=loop, network=network)
    hook.before_zero_grad(loop=loop, network=network)
    fast.zero_grad(optimizer)
    hook.after_zero_grad(loop=loop, network=network)
