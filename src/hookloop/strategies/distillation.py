"""Knowledge distillation: a frozen teacher, a student trained to match it.

::

    loop = Loop(
        networks={"teacher": Network(teacher, None), "student": Network(student, opt)},
        strategy=Distillation(temperature=2.0, alpha=0.5),
        train_data=train_dataloader, eval_data=eval_dataloader,
    )
    loop.fit(epochs=3)          # metrics: the student's eval_loss and eval_accuracy

One batch, in order::

    teacher forward, under torch.no_grad() (eval mode, no gradients)
    student forward
    compute_loss(student) on {"student": outputs, "teacher": outputs}
    backward, after_backward(student), optimizer hooks (student)

The teacher is one of the strategy's ``frozen_networks``: it has no
optimizer (``Network(teacher, None)``), the loop prepares it for evaluation
(no DDP wrapper: nothing to synchronise) and never puts it in train mode, and
the strategy switches its parameters' ``requires_grad`` off when ``fit``
starts. Only the student is evaluated (``eval_step`` returns its outputs; the
default metrics plugin turns them into ``eval_loss`` / ``eval_accuracy``).

What ``compute_loss`` receives for ``network.name == "student"``: ``outputs``
is a dict, ``"student"``: the student's forward outputs (with a graph),
``"teacher"``: the teacher's (without). The default loss,
:class:`DistillationLoss`, is ``trylast``: a plugin that returns a loss for the
student replaces it (read ``loop.strategy.temperature`` / ``.alpha`` there).
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from ..batches import forward, logits_of, targets_of
from ..markers import hookimpl
from .base import StepOutput, Strategy, loss_and_backward, update

if TYPE_CHECKING:  # names for the annotations only
    from ..network import Network
    from ..protocols import LoopLike


class Distillation(Strategy):
    """Train ``networks["student"]`` on the soft targets of a frozen
    ``networks["teacher"]`` plus the hard labels (Hinton et al., 2015):

    ``loss = alpha * T² * KL(softmax(teacher / T) || softmax(student / T))
    + (1 - alpha) * cross_entropy(student, labels)``

    :param temperature: ``T`` (> 0): softens both distributions; the ``T²``
        factor keeps the soft term's gradients the size of the hard term's.
    :param alpha: weight of the soft term, in ``[0, 1]`` (``1``: soft
        targets only; ``0``: labels only, the teacher's forward wasted).

    Batches are read as the supervised strategy reads them (a mapping goes to
    ``model(**batch)``, ``(inputs, targets)`` to ``model(inputs)``), the same
    batch to both networks, so teacher and student share a tokenizer or an
    input format. A batch without targets trains on the soft term alone
    (weight 1): unlabelled transfer data.
    """

    name = "distillation"
    network_names = ("teacher", "student")
    frozen_networks = ("teacher",)

    def __init__(self, temperature: float = 2.0, alpha: float = 0.5) -> None:
        if not isinstance(temperature, numbers.Real) or isinstance(temperature, bool) or not temperature > 0:
            raise ValueError(f"Distillation: temperature must be a positive number, got {temperature!r}")
        if not isinstance(alpha, numbers.Real) or isinstance(alpha, bool) or not 0 <= alpha <= 1:
            raise ValueError(f"Distillation: alpha must be a number in [0, 1], got {alpha!r}")
        self.temperature = temperature
        self.alpha = alpha

    def default_plugins(self) -> list[Any]:
        from ..plugins.metrics import DefaultMetrics

        return [DistillationLoss(), DefaultMetrics()]

    def check_networks(self, networks: Mapping[str, Network]) -> None:
        super().check_networks(networks)
        teacher = networks["teacher"]
        if teacher.optimizer is not None or teacher.scheduler is not None:
            raise ValueError(
                "the distillation strategy never trains the teacher: pass it without an "
                "optimizer, networks={'teacher': Network(teacher, None), "
                "'student': Network(student, optimizer)}"
            )
        if networks["student"].optimizer is None:
            raise ValueError("the distillation strategy trains the student: give it an "
                             "optimizer, Network(student, optimizer)")

    @hookimpl(tryfirst=True)
    def on_fit_start(self, loop: LoopLike) -> None:
        teacher = loop.networks["teacher"]
        teacher.unwrapped.requires_grad_(False)
        teacher.model.eval()  # the loop keeps it so; also when built with prepare=False

    @hookimpl(trylast=True)
    def training_step(self, loop: LoopLike, batch: Any) -> StepOutput:
        teacher, student = loop.networks["teacher"], loop.networks["student"]
        with torch.no_grad():
            teacher_outputs = forward(teacher.model, batch)
        with loop.accumulate(student.model):
            outputs = {"student": forward(student.model, batch), "teacher": teacher_outputs}
            loss = loss_and_backward(loop, student, batch, outputs)
            update(loop, student)
        return StepOutput(outputs, loss)

    @hookimpl(trylast=True)
    def eval_step(self, loop: LoopLike, batch: Any) -> Any:
        return forward(loop.networks["student"].model, batch)


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                      targets: torch.Tensor | None = None, temperature: float = 2.0,
                      alpha: float = 0.5) -> torch.Tensor:
    """``alpha * T² * KL(softmax(t/T) || softmax(s/T)) + (1 - alpha) *
    cross_entropy(s, targets)``, the KL averaged over examples
    (``reduction="batchmean"``). Logits of shape ``(..., classes)`` are
    flattened to one row per position; targets of ``-100`` are ignored by the
    hard term. Without ``targets``: the soft term alone."""
    classes = student_logits.shape[-1]
    s = student_logits.reshape(-1, classes).float()
    t = teacher_logits.reshape(-1, classes).float()
    T = temperature
    soft = F.kl_div(F.log_softmax(s / T, dim=-1), F.softmax(t / T, dim=-1), reduction="batchmean") * T * T
    if targets is None:
        return soft
    return alpha * soft + (1 - alpha) * F.cross_entropy(s, targets.reshape(-1))


class DistillationLoss:
    """The distillation strategy's default loss, :func:`distillation_loss`
    on the student's and the teacher's logits and the batch's targets.

    ``trylast`` and silent for any network but ``"student"``, so a user's
    ``compute_loss`` plugin replaces it. ``temperature`` / ``alpha`` default to
    the strategy's (read at every step: a plugin may change them during
    training).
    """

    name = "loss"
    changes_training = True

    def __init__(self, temperature: float | None = None, alpha: float | None = None) -> None:
        self.temperature = temperature
        self.alpha = alpha

    @hookimpl(trylast=True)
    def compute_loss(self, loop: LoopLike, network: Network, batch: Any,
                     outputs: Mapping[str, Any]) -> torch.Tensor | None:
        if network.name != "student":
            return None
        strategy = loop.strategy
        T = self.temperature if self.temperature is not None else strategy.temperature
        alpha = self.alpha if self.alpha is not None else strategy.alpha
        return distillation_loss(logits_of(outputs["student"]), logits_of(outputs["teacher"]),
                                 targets_of(batch), T, alpha)
