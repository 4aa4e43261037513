"""The default loss: what the model computed, else cross-entropy."""

import torch.nn.functional as F
from torch import Tensor

from ..batches import logits_of, loss_of, targets_of
from ..markers import hookimpl


class DefaultLoss:
    """``outputs.loss`` when the model returns one (a Hugging Face model given
    ``labels``), else ``cross_entropy(logits, targets)``.

    ``trylast``, and registered after the plugins: every plugin's
    ``compute_loss``, ``trylast`` ones included, runs first and replaces it
    by returning a tensor. A plugin named ``"loss"`` replaces it,
    ``block=["loss"]`` removes it.
    """

    name = "loss"
    changes_training = True

    @hookimpl(trylast=True)
    def compute_loss(self, network, batch, outputs):
        kind = type(batch)
        if type(outputs) is Tensor and (kind is tuple or kind is list) and len(batch) >= 2:
            # logits and an (inputs, targets, ...) batch: what the helpers
            # below find for them, without their three calls
            return F.cross_entropy(outputs, batch[1])
        loss = loss_of(outputs)
        if loss is not None:
            return loss
        targets = targets_of(batch)
        if targets is None:
            raise ValueError(
                f"network {network.name!r}: the model returned no loss and the batch "
                "has no targets (no 'labels' key, no second element). Pass labels, "
                "or write a plugin that implements compute_loss."
            )
        return F.cross_entropy(logits_of(outputs), targets)
