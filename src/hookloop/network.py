"""One trainable network: a model with its optimizer and optional scheduler."""

import warnings
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
        untrained = self.untrained_parameters()
        if untrained:
            who = f"network {self.name!r}" if self.name else f"Network({type(self.unwrapped).__name__})"
            shown = ", ".join(untrained[:5]) + (f" and {len(untrained) - 5} more" if len(untrained) > 5 else "")
            warnings.warn(
                f"{who}: {len(untrained)} parameter(s) require grad but are in no param group of "
                f"its optimizer ({type(self.optimizer).__name__}), so they never train: {shown}. "
                "Add them to the optimizer, or set requires_grad=False (a plugin that adds them "
                "later, unfreezing a backbone, should also restore them before the optimizer "
                "state on resume: load_state_dict_early)",
                RuntimeWarning,
                stacklevel=3,
            )

    def untrained_parameters(self) -> list[str]:
        """Names of the model's parameters that require grad but are in no
        param group of the optimizer (they would train frozen)."""
        groups = getattr(self.optimizer, "param_groups", None)
        named = getattr(self.unwrapped, "named_parameters", None)
        if groups is None or not callable(named):
            return []
        in_groups = {id(p) for group in groups for p in group.get("params", ())}
        return [name for name, p in named() if p.requires_grad and id(p) not in in_groups]

    def __repr__(self):
        return f"Network(name={self.name!r}, model={type(self.unwrapped).__name__})"
