"""Strategies: what one training step does. A strategy is a plugin that
implements ``training_step`` (and ``eval_step``) ``trylast``, names the
networks it needs (``check_networks``) and brings its default plugins
(``default_plugins``, e.g. its default loss). Built in: :class:`Supervised`
(one network), :class:`GAN` (two), :class:`Distillation` (a frozen teacher and
a student). The kit to write one: :mod:`hookloop.strategy`."""

from .base import StepOutput, Strategy
from .distillation import Distillation, DistillationLoss, distillation_loss
from .gan import GAN, GANLoss
from .supervised import Supervised

__all__ = ["GAN", "Distillation", "DistillationLoss", "GANLoss", "StepOutput", "Strategy",
           "Supervised", "distillation_loss"]
