"""Everything a side trip through training changes, taken before it and
put back after: :class:`RunSnapshot`. The learning-rate finder
(:mod:`hookloop.lr_finder`) trains a hundred updates with it and leaves the
run bitwise as it was.

What it holds: every network's parameters (values, ``requires_grad``,
gradients), buffers (persistent or not) and each submodule's train/eval mode;
every optimizer's state and param groups; every scheduler's state; the
gradient scaler's; the given plugins' ``state_dict()``; the loop's hook relay,
its accumulation settings and counters; Accelerate's micro-step counter;
``loop.state`` (all of it but the run's identity); the global random states,
the training data's generators and its own samplers' states
(:func:`hookloop.rng.capture_epoch`), and the attributes of the loader and of
the one Accelerate wraps, as they were bound (its epoch counter ``iteration``,
a stateful loader's state, the iterator it keeps: set aside meanwhile, so
that the side trip's passes make their own). Tensors are copied
to the CPU (a GPU's memory stays free for the side trip) and copied back bit
for bit; a tensor subclass (a ``DTensor``) is copied where it is.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

from . import rng


#: where a loader keeps an iterator it hands out again, and what it holds
#: when there is none: torch's ``DataLoader`` its persistent workers'
#: iterator (reset, not remade, by the next pass), torchdata's
#: ``StatefulDataLoader`` also the first iterator, made for ``state_dict()``
#: and handed to the first pass. Set aside while a side trip runs, so that
#: its passes do not advance the iterator the run's next pass gets.
_KEPT_ITERATOR = {"_iterator": None, "_initial_iter_for_state_dict": False}


class _Held:
    """A tensor's copy, on the CPU when it is a plain tensor (a GPU's memory
    stays free for the side trip), and the device it goes back to."""

    __slots__ = ("tensor", "device")

    def __init__(self, tensor: torch.Tensor) -> None:
        data = tensor.detach()
        self.device: torch.device | None
        if type(data) is torch.Tensor:
            self.tensor, self.device = data.to("cpu", copy=True), data.device
        else:  # a tensor subclass (DTensor, ...): copied where it is
            self.tensor, self.device = data.clone(), None

    def get(self) -> torch.Tensor:
        return self.tensor if self.device is None else self.tensor.to(self.device)


def _hold(obj: Any) -> Any:
    """A deep copy of ``obj`` (a state dict) whose tensors are :class:`_Held`."""
    if isinstance(obj, torch.Tensor):
        return _Held(obj)
    if type(obj) is dict:
        return {key: _hold(value) for key, value in obj.items()}
    if type(obj) is list:
        return [_hold(value) for value in obj]
    if type(obj) is tuple:
        return tuple(_hold(value) for value in obj)
    return copy.deepcopy(obj)


def _unhold(obj: Any) -> Any:
    if isinstance(obj, _Held):
        return obj.get()
    if type(obj) is dict:
        return {key: _unhold(value) for key, value in obj.items()}
    if type(obj) is list:
        return [_unhold(value) for value in obj]
    if type(obj) is tuple:
        return tuple(_unhold(value) for value in obj)
    return obj


class _ModuleState:
    """A module's parameters (values, ``requires_grad``, gradients), buffers
    (persistent or not) and every submodule's train/eval mode."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.parameters = {name: (_Held(p), p.requires_grad, None if p.grad is None else _Held(p.grad))
                           for name, p in module.named_parameters()}
        self.buffers = {name: _Held(b) for name, b in module.named_buffers()}
        self.modes = [(m, m.training) for m in module.modules()]

    def restore(self) -> None:
        module = self.module
        with torch.no_grad():
            for name, p in module.named_parameters():
                if name in self.parameters:
                    value, requires_grad, grad = self.parameters[name]
                    p.copy_(value.tensor)
                    p.requires_grad_(requires_grad)
                    p.grad = None if grad is None else grad.get()
            for name, b in module.named_buffers():
                if name in self.buffers:
                    saved = self.buffers[name].get()
                    if b.shape == saved.shape and b.dtype == saved.dtype:
                        b.copy_(saved)
                    else:  # replaced by another tensor during the sweep: the old one back
                        owner, _, leaf = name.rpartition(".")
                        setattr(module.get_submodule(owner), leaf, saved)
        for m, training in self.modes:
            m.training = training


class RunSnapshot:
    """Everything a side trip through training may change, taken when it is
    made; :meth:`restore` puts it back (the module's docstring lists it).
    ``plugins``: the stateful plugins whose ``state_dict()`` is put back (those
    whose hooks run during the side trip)."""

    def __init__(self, loop: Any, plugins: Sequence[Any] = ()) -> None:
        self.loop = loop
        acc, data = loop.accelerator, loop.train_data
        networks = list(loop.networks.values())
        self.modules = [_ModuleState(n.unwrapped) for n in networks]
        self.networks = [(n, n.scheduler, n.grad_norm, n.backward_hooked) for n in networks]
        self.optimizers = [(n.optimizer, _hold(n.optimizer.state_dict())) for n in networks
                           if n.optimizer is not None]
        self.schedulers = [(n.scheduler, copy.deepcopy(n.scheduler.state_dict())) for n in networks
                           if n.scheduler is not None]
        self.scaler = copy.deepcopy(acc.scaler.state_dict()) if acc.scaler is not None else None
        self.plugins = [(plugin, _hold(plugin.state_dict())) for plugin in plugins]
        self.hook = loop.plugins.hook
        self.loop_fields = {name: getattr(loop, name) for name in (
            "fastpath", "_accumulation", "accumulating", "_discarded", "discarded_updates")}
        self.logbook_step = loop._logbook.step
        self.accelerator_step = acc.step
        self.state = copy.deepcopy({k: v for k, v in vars(loop.state).items() if k != "run"})
        self.random = copy.deepcopy(rng.capture_epoch(data))  # global RNG, data generators, own samplers
        self.iteration = getattr(data, "iteration", None)  # Accelerate's epoch counter of the loader
        #: the attributes of the loader and of the one Accelerate wraps: its epoch counter, a stateful
        #: loader's state (Accelerate's copy, torchdata's pending one), the iterator a pass left
        self.loaders = [(obj, dict(vars(obj))) for obj in (data, getattr(data, "base_dataloader", None))
                        if obj is not None and hasattr(obj, "__dict__")]
        for obj, _ in self.loaders:  # the side trip's passes make iterators of their own
            bound = vars(obj)
            for name, aside in _KEPT_ITERATOR.items():
                if name in bound:
                    bound[name] = aside

    def restore(self) -> None:
        loop = self.loop
        acc, data = loop.accelerator, loop.train_data
        loop.plugins.hook = self.hook
        for network, scheduler, grad_norm, hooked in self.networks:
            network.scheduler, network.grad_norm, network.backward_hooked = scheduler, grad_norm, hooked
        for module in self.modules:
            module.restore()
        for optimizer, state in self.optimizers:
            optimizer.load_state_dict(_unhold(state))
        for scheduler, state in self.schedulers:
            scheduler.load_state_dict(state)
        if self.scaler is not None:
            acc.scaler.load_state_dict(self.scaler)
        for plugin, state in self.plugins:
            plugin.load_state_dict(_unhold(state))
        for name, value in self.loop_fields.items():
            setattr(loop, name, value)
        loop._logbook.step = self.logbook_step
        acc.step = self.accelerator_step
        for key, value in self.state.items():
            setattr(loop.state, key, value)
        if self.iteration is not None and data.iteration != self.iteration and hasattr(data, "set_epoch"):
            data.set_epoch(self.iteration)  # a pass ran out: its samplers' epoch back too
        for obj, attributes in self.loaders:  # as bound before: what the sweep's passes set goes
            bound = vars(obj)
            for name in [name for name in bound if name not in attributes]:
                del bound[name]
            bound.update(attributes)
        rng.restore_generators(data, self.random["generators"])
        rng.restore_rng(self.random["rng"])  # last: nothing draws after it


__all__ = ["RunSnapshot"]
