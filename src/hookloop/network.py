"""Networks: a model with its optimizer and optional scheduler, how a Loop's
networks are given, and how they are prepared with the accelerator."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch


class _NotMeasured:
    """``network.grad_norm`` while no plugin measures the gradient norm: falsy,
    and a clear error where it would be used as a number."""

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "NOT_MEASURED"

    def __float__(self) -> float:
        raise ValueError("network.grad_norm was not measured: no plugin measures the gradient norm "
                         "(GradClip(max_norm=...) does, at every update); test "
                         "`network.grad_norm is not NOT_MEASURED` first")

    item = __float__


#: ``network.grad_norm`` until a plugin measures it (``hookloop.NOT_MEASURED``)
NOT_MEASURED: Any = _NotMeasured()


@dataclass(eq=False)
class Network:
    """A model, the optimizer that updates it and, optionally, its scheduler.

    ``Loop(networks={"generator": Network(G, opt_g), ...})`` names each one;
    the loop fills in ``name`` and, once ``accelerator.prepare`` ran, replaces
    ``model``, ``optimizer`` and ``scheduler`` by their prepared versions
    (``unwrapped`` keeps the plain ``torch.nn.Module``).

    When the scheduler steps, as Lightning's ``lr_scheduler`` config says it
    (``{"scheduler": s, "interval": "epoch", "frequency": 1, "monitor": ...}``):
    ``scheduler_interval="step"`` (default) after every ``scheduler_frequency``-th
    optimizer update, ``"epoch"`` once after every ``scheduler_frequency``-th
    epoch (its end, after its evaluation, before ``on_epoch_end``; an epoch
    ended early by a stop is not over and does not step it), exactly once
    whatever the number of processes. ``scheduler_monitor``: a metric of the
    epoch passed to the scheduler's ``step`` (``ReduceLROnPlateau``).
    """

    model: Any
    optimizer: Any = None
    scheduler: Any = None
    name: str = ""
    #: the plain module, before any DDP/FSDP wrapping
    unwrapped: Any = None
    #: the last gradient norm a clipping plugin measured (a 0-d tensor), for
    #: logging; :data:`NOT_MEASURED` (falsy) while no plugin measures it
    #: (``GradClip(max_norm=...)`` does, at every update)
    grad_norm: Any = NOT_MEASURED
    #: ``"step"`` or ``"epoch"``: when the scheduler steps
    scheduler_interval: str = "step"
    #: every how many steps (updates) or epochs
    scheduler_frequency: int = 1
    #: a metric of the epoch given to ``scheduler.step(value)`` (epoch interval)
    scheduler_monitor: str | None = None
    #: set by :func:`~hookloop.strategy.loss_and_backward` once its
    #: ``after_backward`` ran, cleared by :func:`~hookloop.strategy.update`,
    #: which calls ``after_backward`` itself when it is not set
    backward_hooked: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.unwrapped is None:
            self.unwrapped = self.model
        check_schedule(self)
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

    def __repr__(self) -> str:
        return f"Network(name={self.name!r}, model={type(self.unwrapped).__name__})"


def check_schedule(network: Network) -> None:
    """A scheduler interval, frequency and monitor that mean something."""
    if network.scheduler_interval not in ("step", "epoch"):
        raise ValueError(f"Network: scheduler_interval must be 'step' or 'epoch', got "
                         f"{network.scheduler_interval!r}")
    frequency = network.scheduler_frequency
    if not isinstance(frequency, int) or isinstance(frequency, bool) or frequency < 1:
        raise ValueError(f"Network: scheduler_frequency must be a positive int, got {frequency!r}")
    if network.scheduler_monitor is not None and network.scheduler_interval != "epoch":
        raise ValueError("Network: scheduler_monitor (a metric given to the scheduler) needs "
                         "scheduler_interval='epoch': the metrics exist at the epoch's end")


def networks_from(model: Any, optimizer: Any, scheduler: Any, networks: Any, strategy: Any,
                  schedule: dict[str, Any] | None = None) -> dict[str, Network]:
    """``Loop(model=, optimizer=, scheduler=)`` or ``Loop(networks={...})`` as
    ``{name: Network}``, checked before anything is prepared: every model a
    ``torch.nn.Module``, every network the strategy trains with an optimizer,
    no optimizer or scheduler shared by two networks, no class given where an
    instance belongs."""
    if inspect.isclass(strategy):
        raise TypeError(f"strategy= is the class {_class_name(strategy)}, not a strategy: "
                        f"pass strategy={strategy.__qualname__}(...)")
    if networks is not None:
        if model is not None or optimizer is not None or scheduler is not None:
            raise ValueError("pass either model=/optimizer=/scheduler= or networks=, not both")
        if schedule:
            raise ValueError("Loop(scheduler_interval=...) is for Loop(model=, optimizer=, scheduler=): "
                             "with networks= give each Network(..., scheduler_interval=...)")
        if not isinstance(networks, Mapping) or not networks:
            raise ValueError("networks= must be a non-empty dict of name -> Network(...)")
        out = {}
        for name, network in networks.items():
            if not isinstance(network, Network):
                what = (f"the class {_class_name(network)}, not an instance" if inspect.isclass(network)
                        else f"a {type(network).__name__}")
                raise TypeError(
                    f"networks[{name!r}] is {what}: wrap it as "
                    f"Network(model, optimizer, scheduler=None)"
                )
            network.name = name
            out[name] = network
    else:
        if model is None:
            raise ValueError("Loop needs model=... (one network) or networks={...}")
        for what, obj, fix in (("model", model, "(...)"), ("optimizer", optimizer, "(model.parameters(), ...)"),
                               ("scheduler", scheduler, "(optimizer, ...)")):
            if inspect.isclass(obj):  # before Network(...), which would fail on it obscurely
                raise TypeError(f"{what}= is the class {_class_name(obj)}, not an instance: "
                                f"pass {what}={obj.__qualname__}{fix}")
        out = {"model": Network(model, optimizer, scheduler, name="model", **(schedule or {}))}
    for name, network in out.items():
        for what in ("optimizer", "scheduler"):
            obj = getattr(network, what)
            if inspect.isclass(obj):
                raise TypeError(f"network {name!r}: {what} is the class {_class_name(obj)}, not an "
                                f"instance: pass {obj.__qualname__}(...)")
        if not isinstance(network.model, torch.nn.Module):
            what = (f"the class {_class_name(network.model)}, not an instance" if inspect.isclass(network.model)
                    else f"a {type(network.model).__name__}, not a torch.nn.Module")
            raise TypeError(f"network {name!r}: model is {what}")
        if network.optimizer is None and name not in getattr(strategy, "frozen_networks", ()):
            raise ValueError(
                f"network {name!r} has no optimizer, and the strategy {strategy.name!r} trains "
                "it (only a strategy's frozen_networks may have none)"
            )
    _refuse_shared(out)
    return out


def _class_name(cls: Any) -> str:
    module = getattr(cls, "__module__", None)
    return cls.__qualname__ if module in (None, "builtins", "__main__") else f"{module}.{cls.__qualname__}"


def _refuse_shared(networks: Mapping[str, Network]) -> None:
    """One optimizer (or scheduler) in two networks would be stepped once per
    network, twice per batch: refuse it, saying how several modules share
    one optimizer (one Network whose model holds them)."""
    for what in ("optimizer", "scheduler"):
        owner: dict[int, str] = {}
        for name, network in networks.items():
            obj = getattr(network, what)
            if obj is None:
                continue
            first = owner.setdefault(id(obj), name)
            if first == name:
                continue
            raise ValueError(
                f"networks {first!r} and {name!r} are given the same {what} "
                f"({type(obj).__name__}): the loop steps every network's {what} once per "
                f"update, so this one would step twice. Give each network its own {what}, or "
                "put the modules that share it in one Network: Network(Parts({"
                f"{first!r}: ..., {name!r}: ...}}), optimizer), with Parts a "
                "torch.nn.ModuleDict whose forward(part, *args) returns self[part](*args), "
                "and run them as network.model(part, x) (docs/plugins.md, "
                "\"Several modules, one optimizer\")"
            )


def prepare(accelerator: Any, networks: Mapping[str, Network], frozen: Any, train_data: Any,
            eval_loaders: list[Any]) -> tuple[Any, list[Any]]:
    """Pass every network's model, optimizer and scheduler and the data
    through ``accelerator.prepare`` (frozen networks through
    ``prepare_model(evaluation_mode=True)``: no DDP wrapper, eval mode),
    replacing them in the networks. Returns the prepared ``(train_data,
    eval_loaders)``.

    Accelerate returns one object, a tuple, or (FSDP2) a list: all taken."""
    for name in frozen:  # evaluation_mode: no DDP wrapper, nothing to synchronise
        network = networks[name]
        network.model = accelerator.prepare_model(network.model, evaluation_mode=True)
        network.model.eval()
    trained = [n for name, n in networks.items() if name not in frozen]
    with_opt = [n for n in trained if n.optimizer is not None]
    with_sched = [n for n in trained if n.scheduler is not None]
    data = [d for d in (train_data, *eval_loaders) if d is not None]
    given = [*(n.model for n in trained), *(n.optimizer for n in with_opt), *data,
             *(n.scheduler for n in with_sched)]
    prepared = accelerator.prepare(*given)
    prepared = list(prepared) if isinstance(prepared, (tuple, list)) and len(given) != 1 else [prepared]
    if len(prepared) != len(given):
        raise RuntimeError(f"accelerator.prepare returned {len(prepared)} objects for the {len(given)} given")
    it = iter(prepared)
    for n in trained:
        n.model = next(it)
    for n in with_opt:
        n.optimizer = next(it)
    if train_data is not None:
        train_data = next(it)
    eval_loaders = [next(it) for _ in eval_loaders]
    for n in with_sched:
        n.scheduler = next(it)
    return train_data, eval_loaders
