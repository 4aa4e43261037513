"""The strategy kit: what a strategy is made of, at one stable import path.

::

    from hookloop.strategy import Strategy, StepOutput, hookimpl, loss_and_backward, update

A *strategy* decides what one training step does (one network, a GAN's two,
a teacher and a student). It is a plugin, registered first among the
built-ins, that the loop asks for a few things (:class:`Strategy` documents
each):

``name``
    the plugin name (``"supervised"``, ``"gan"``, ``"distillation"``).
``network_names``
    the keys of ``Loop(networks={...})`` it trains.
``frozen_networks``
    the networks it uses without training them: they may have
    ``optimizer=None``; the loop prepares them for evaluation (no DDP
    wrapper) and keeps them in eval mode. The strategy switches off their
    ``requires_grad`` itself.
``check_networks(networks)``
    raise ``ValueError`` at ``Loop(...)`` when the networks do not fit.
``default_plugins()``
    the plugins that come with it: a default loss (``trylast``), the default
    metrics, each replaceable by a user plugin of the same name.
``training_step(loop, batch)`` (hook, ``trylast``)
    the step: forwards, then per trained network :func:`loss_and_backward`
    and :func:`update`, inside ``loop.accumulate(*trained models)`` entered
    once per batch; returns a :class:`StepOutput`.
``eval_step(loop, batch)`` (hook, ``trylast``)
    the forward outputs of the network to evaluate; metric plugins receive
    them in ``after_eval_step``.

The functions do a network's part of a step with every per-network hook in
its place, exactly as the built-in strategies do (which use nothing else):

- :func:`loss_and_backward`: ``compute_loss``, ``before_backward``,
  ``accelerator.backward``, ``after_backward``; a bad loss names the plugin
  that returned it.
- :func:`update`: optimizer step, scheduler step, ``zero_grad``, each between
  its hooks (the hooks on synchronised steps only).
- :func:`backward`: ``accelerator.backward(loss)`` alone, without hooks.
- :func:`frozen`: a network's parameters without gradients for a block (back-
  propagate through it into another network).
- the batch helpers :func:`forward` (``model(**batch)``, ``model(inputs)``,
  ``model(tensor)``), :func:`targets_of`, :func:`logits_of`, :func:`loss_of`.

``docs/plugins.md`` ("Writing a strategy") builds a strategy from scratch.
The names here are stable from 0.2 on.
"""

from .batches import forward, logits_of, loss_of, targets_of
from .markers import hookimpl
from .strategies.base import (
    StepOutput,
    Strategy,
    backward,
    check_loss,
    frozen,
    loss_and_backward,
    returning_plugin,
    update,
)

__all__ = [
    "StepOutput",
    "Strategy",
    "backward",
    "check_loss",
    "forward",
    "frozen",
    "hookimpl",
    "logits_of",
    "loss_and_backward",
    "loss_of",
    "returning_plugin",
    "targets_of",
    "update",
]
