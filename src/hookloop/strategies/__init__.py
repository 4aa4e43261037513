"""Strategies: what one training step does. A strategy is a plugin that
implements ``training_step`` (and ``eval_step``) ``trylast``, names the
networks it needs (``check_networks``) and brings its default plugins
(``default_plugins``, e.g. its default loss)."""

from .base import StepOutput
from .gan import GAN, GANLoss
from .supervised import Supervised

__all__ = ["GAN", "GANLoss", "StepOutput", "Supervised"]
