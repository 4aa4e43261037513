"""The default strategy: one network named ``"model"``, supervised."""

import torch.nn.functional as F

from ..batches import forward, logits_of, loss_of, targets_of
from ..markers import hookimpl
from ..plugins.loss import DefaultLoss
from .base import StepOutput, loss_and_backward, update


class Supervised:
    """One network, ``loop.networks["model"]``: forward, ``compute_loss``,
    ``accelerator.backward``, then optimizer, scheduler and ``zero_grad``,
    inside ``accelerator.accumulate`` when gradient accumulation is on.

    Batches: see :mod:`hookloop.batches`. Evaluation returns per-example
    cross-entropy (``eval_loss``) and ``eval_accuracy`` of the arg-max.
    """

    name = "supervised"
    network_names = ("model",)

    def default_plugins(self):
        return [DefaultLoss()]

    def check_networks(self, networks):
        if set(networks) != {"model"}:
            raise ValueError(
                "the supervised strategy trains one network named 'model' "
                f"(Loop(model=..., optimizer=...)); got networks {sorted(networks)}. "
                "For several networks pass a strategy, e.g. strategy=GAN(...)."
            )

    @hookimpl(trylast=True)
    def training_step(self, loop, batch):
        network = loop.networks["model"]
        with loop.accumulate(network.model):
            outputs = forward(network.model, batch)
            loss = loss_and_backward(loop, network, batch, outputs)
            update(loop, network)
        return StepOutput(outputs, loss)

    @hookimpl(trylast=True)
    def eval_step(self, loop, batch):
        outputs = forward(loop.networks["model"].model, batch)
        targets = targets_of(batch)
        gather = loop.accelerator.gather_for_metrics
        if targets is None:
            loss = loss_of(outputs)
            if loss is None:
                raise ValueError(
                    "eval_data batches have no targets and the model returned no loss: "
                    "write a plugin that implements eval_step"
                )
            return {"eval_loss": gather(loss.detach().reshape(1))}
        logits = logits_of(outputs)
        loss = F.cross_entropy(logits, targets, reduction="none")
        correct = (logits.argmax(dim=-1) == targets).float()
        loss, correct = gather((loss, correct))
        return {"eval_loss": loss, "eval_accuracy": correct}
