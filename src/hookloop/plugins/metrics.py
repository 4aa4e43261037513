"""The default evaluation metrics: loss and accuracy, per example (and the
perplexity of a model that computes its own loss)."""

import math

import torch
import torch.nn.functional as F

from ..batches import logits_of, loss_of, targets_of
from ..evaluation import metric_key
from ..markers import hookimpl


class DefaultMetrics:
    """``eval_loss`` and ``eval_accuracy`` of every evaluation example, a
    default plugin of the supervised strategy (block it with
    ``block=["metrics"]``).

    - One integer target per example against logits ``(batch, classes)``:
      per-example cross-entropy and accuracy of the arg-max.
    - Otherwise, when the model computed a loss itself (a causal language
      model given ``labels`` shifts them inside): ``eval_loss`` is that loss,
      counted once per example of the batch, as the Hugging Face Trainer
      counts it, and ``perplexity`` is ``exp(eval_loss)`` (as
      ``run_clm_no_trainer.py`` reports it; ``inf`` when it overflows).
    - Otherwise targets of shape ``logits.shape[:-1]`` (one per position):
      cross-entropy and accuracy per example, averaged over its positions
      (targets ``-100`` ignored, as Hugging Face models do).

    Values go through ``gather_for_metrics``: every example once over all
    processes.

    A ``compute_loss`` plugin changes the loss training minimises, not this
    ``eval_loss``: a plugin evaluated by its own loss returns it per example
    as ``eval_loss`` from ``after_eval_step`` with ``replaces = ("metrics",)``.
    """

    name = "metrics"
    changes_training = False

    def __init__(self):
        self._own_loss = set()  # the evaluation sets evaluated with the model's own loss

    @hookimpl
    def on_eval_start(self):
        self._own_loss = set()

    @hookimpl(trylast=True)
    def on_eval_end(self, metrics):
        for eval_set in self._own_loss:
            loss = metrics.get(metric_key(eval_set, "eval_loss"))
            if loss is not None:
                try:
                    metrics[metric_key(eval_set, "perplexity")] = math.exp(loss)
                except OverflowError:
                    metrics[metric_key(eval_set, "perplexity")] = float("inf")

    @hookimpl(trylast=True)
    def after_eval_step(self, loop, batch, outputs, eval_set):
        gather = loop.accelerator.gather_for_metrics
        targets = targets_of(batch)
        logits = _logits_or_none(outputs)
        fit = targets is not None and logits is not None and _fit(logits, targets)
        if fit and logits.ndim == 2:  # classification: one target per example
            return dict(zip(("eval_loss", "eval_accuracy"), gather(_per_example(logits, targets))))
        loss = loss_of(outputs)
        if loss is not None:  # the model's own loss: it knows how its labels line up
            self._own_loss.add(eval_set)
            n = _batch_size(batch, targets, logits)
            return {"eval_loss": gather(loss.detach().float().reshape(1).repeat(n))}
        if fit:  # one target per position (token classification), no loss from the model
            return dict(zip(("eval_loss", "eval_accuracy"), gather(_per_example(logits, targets))))
        if logits is None:  # not a model's outputs: name who returned them
            from ..strategies.base import returning_plugin

            who = returning_plugin(loop, "eval_step", loop=loop, batch=batch, eval_set=eval_set)
            exc = TypeError(
                f"eval_step returned {type(outputs).__name__}" + (f" (plugin {who!r})" if who else "")
                + ": the default metrics need the model's outputs (logits, .logits or .loss); return "
                "those from eval_step, or block=['metrics'] and compute metrics in after_eval_step"
            )
            if who:
                exc.hookloop_culprit = (who, "eval_step")
            raise exc
        what = "no targets" if targets is None else (
            f"targets of shape {tuple(targets.shape)} that do not fit logits of shape "
            f"{tuple(logits.shape) if logits is not None else '?'}")
        raise ValueError(
            f"eval_data batches have {what}, and the model returned no loss: pass "
            "labels the model uses, or write a plugin that implements after_eval_step "
            "(block=['metrics'] removes this one)"
        )


def _logits_or_none(outputs):
    try:
        return logits_of(outputs)
    except TypeError:
        return None


def _fit(logits, targets) -> bool:
    return (
        isinstance(targets, torch.Tensor)
        and not targets.is_floating_point()
        and logits.ndim == targets.ndim + 1
        and tuple(logits.shape[:-1]) == tuple(targets.shape)
    )


def _per_example(logits, targets):
    """Cross-entropy and correctness per example, averaged over the other
    (sequence) positions, ignoring targets of -100."""
    loss = F.cross_entropy(logits.movedim(-1, 1), targets, reduction="none", ignore_index=-100)
    correct = (logits.argmax(dim=-1) == targets).float()
    if targets.ndim == 1:
        return loss, correct
    valid = (targets != -100).float().flatten(1)
    n = valid.sum(dim=1).clamp(min=1)
    return (loss.flatten(1) * valid).sum(1) / n, (correct.flatten(1) * valid).sum(1) / n


def _batch_size(batch, targets, logits):
    for tensor in (targets, logits):
        if isinstance(tensor, torch.Tensor) and tensor.ndim:
            return tensor.shape[0]
    if isinstance(batch, dict):
        for value in batch.values():
            if isinstance(value, torch.Tensor) and value.ndim:
                return value.shape[0]
    return 1
