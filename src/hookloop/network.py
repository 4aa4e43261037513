"""One trainable network: a model with its optimizer and optional scheduler."""

from dataclasses import dataclass
from typing import Any


@dataclass(eq=False)
class Network:
    """A model, the optimizer that updates it and, optionally, its scheduler.

    ``Loop(networks={"generator": Network(G, opt_g), ...})`` names each one;
    the loop fills in ``name`` and, once ``accelerator.prepare`` ran, replaces
    ``model``, ``optimizer`` and ``scheduler`` by their prepared versions
    (``unwrapped`` keeps the plain ``torch.nn.Module``).
    """

    model: Any
    optimizer: Any = None
    scheduler: Any = None
    name: str = ""
    #: the plain module, before any DDP/FSDP wrapping
    unwrapped: Any = None
    #: the last gradient norm a clipping plugin measured (a 0-d tensor), for
    #: logging; ``None`` when nothing clips
    grad_norm: Any = None

    def __post_init__(self):
        if self.unwrapped is None:
            self.unwrapped = self.model

    def __repr__(self):
        return f"Network(name={self.name!r}, model={type(self.unwrapped).__name__})"
