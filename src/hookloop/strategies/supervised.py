"""The default strategy: one network named ``"model"``, supervised."""

from typing import Any

from ..batches import forward
from ..markers import hookimpl
from ..plugins.loss import DefaultLoss
from ..plugins.metrics import DefaultMetrics
from .base import StepOutput, Strategy, loss_and_backward, plain_step, plain_steps, update


class Supervised(Strategy):
    """One network, ``loop.networks["model"]``: forward, ``compute_loss``,
    ``accelerator.backward``, then optimizer, scheduler and ``zero_grad``,
    inside ``accelerator.accumulate`` when gradient accumulation is on.

    Batches: see :mod:`hookloop.batches`. ``eval_step`` returns the model's
    outputs; its default plugin ``metrics``
    (:class:`~hookloop.plugins.metrics.DefaultMetrics`) turns them into
    ``eval_loss`` and ``eval_accuracy``.
    """

    name = "supervised"
    network_names = ("model",)

    def default_plugins(self) -> list[Any]:
        return [DefaultLoss(), DefaultMetrics()]

    def check_networks(self, networks):
        if set(networks) != {"model"}:
            raise ValueError(
                "the supervised strategy trains one network named 'model' "
                f"(Loop(model=..., optimizer=...)); got networks {sorted(networks)}. "
                "For several networks pass a strategy, e.g. strategy=GAN(...)."
            )

    #: the ``(loop.hook, loop.fastpath)`` that :attr:`_plain` was decided for
    _plain_for: tuple = (None, None)
    _plain = False

    @hookimpl(trylast=True)
    def training_step(self, loop, batch):
        network = loop.networks["model"]
        hook, fast = loop.hook, loop.fastpath
        decided = self._plain_for
        if decided[0] is not hook or decided[1] is not fast:
            self._plain, self._plain_for = plain_steps(loop), (hook, fast)
        if self._plain and network.scheduler_interval == "step" and network.scheduler_frequency == 1:
            return plain_step(loop, network, batch, forward)  # the defaults: one frame, no context
        with loop.accumulate(network.model):
            outputs = forward(network.model, batch)
            loss = loss_and_backward(loop, network, batch, outputs)
            update(loop, network)
        return StepOutput(outputs, loss)

    @hookimpl(trylast=True)
    def eval_step(self, loop, batch):
        return forward(loop.networks["model"].model, batch)
