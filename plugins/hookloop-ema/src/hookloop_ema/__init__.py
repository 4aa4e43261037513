"""Exponential moving average of weights, per network, as a hookloop plugin.

::

    loop = Loop(..., plugins=["ema"])                       # decay 0.999, every network
    loop = Loop(..., plugins=[("ema", {"decay": 0.99, "networks": ["generator"]})])

After every optimizer step of a tracked network, its average moves towards
the new weights::

    average = decay * average + (1 - decay) * weights

starting from the weights at the start of training. Evaluation
(``loop.evaluate()``, and the evaluation at every epoch end) runs with the
averaged weights; training continues from the trained ones. The averages are
plugin state (:meth:`EMA.state_dict`): a checkpoint plugin that saves plugin
state keeps them, and a resumed run continues them.
"""

from __future__ import annotations

import contextlib

import torch

from hookloop import hookimpl

__version__ = "0.1.0"

__all__ = ["EMA"]


class EMA:
    """Keep an exponential moving average of each tracked network's
    parameters, and evaluate with it.

    :param decay: in ``[0, 1)``; the weight of the past. ``0.999`` averages
        over roughly the last 1000 steps.
    :param networks: names of the networks to average (default: every network
        of the loop; for a GAN, ``["generator"]`` is the usual choice).
    :param evaluate: swap the averages in for evaluation (``on_eval_start``)
        and the trained weights back (``on_eval_end``). With ``False`` the
        averages are only kept (read them with :meth:`average` or
        :meth:`applied`).

    Only floating-point parameters are averaged; buffers (batch-norm running
    statistics) are left as training made them. Every process keeps the same
    averages (data-parallel parameters are identical after each step).
    """

    name = "ema"
    changes_training = True  # evaluates (and can export) other weights

    def __init__(self, decay: float = 0.999, networks=None, evaluate: bool = True):
        if not (isinstance(decay, (int, float)) and 0.0 <= decay < 1.0):
            raise ValueError(f"EMA: decay must be a number in [0, 1), got {decay!r}")
        if isinstance(networks, str):
            networks = [networks]
        self.decay = float(decay)
        self.networks = list(networks) if networks is not None else None
        self.evaluate = evaluate
        #: network name -> {parameter name: averaged tensor}
        self.shadow: dict[str, dict[str, torch.Tensor]] = {}
        #: network name -> optimizer steps averaged so far
        self.updates: dict[str, int] = {}
        self._swapped: dict | None = None
        self._loaded = False  # averages came from a checkpoint: check and place them
        self._pairs: dict = {}  # network -> (averages, parameters), cached for the fit

    # -- public helpers ------------------------------------------------------

    def average(self, network: str = "model") -> dict[str, torch.Tensor]:
        """A copy of one network's averaged parameters, by parameter name."""
        if network not in self.shadow:
            raise KeyError(f"EMA: no average for network {network!r} (tracked: {sorted(self.shadow)})")
        return {k: v.detach().clone() for k, v in self.shadow[network].items()}

    @contextlib.contextmanager
    def applied(self, loop):
        """Within the block, every tracked network holds its averaged
        parameters (to evaluate, export or save them); afterwards, the
        trained ones again."""
        self._swap_in(loop)
        try:
            yield self
        finally:
            self._swap_out(loop)

    def state_dict(self) -> dict:
        """The averages and step counts, for a checkpoint (tensors on CPU)."""
        return {
            "decay": self.decay,
            "updates": dict(self.updates),
            "shadow": {
                net: {k: v.detach().to("cpu", copy=True) for k, v in params.items()}
                for net, params in self.shadow.items()
            },
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output (before or after ``on_fit_start``:
        averages already loaded are kept, not reset to the current weights)."""
        self.decay = float(state["decay"])
        self.updates = dict(state["updates"])
        self.shadow = {net: dict(params) for net, params in state["shadow"].items()}
        self._loaded = True

    # -- hooks -----------------------------------------------------------------

    @hookimpl
    def on_fit_start(self, loop):
        self._pairs = {}
        for name in self._tracked(loop):
            if name not in self.shadow:  # a fresh start (not a resume): the initial weights
                params = _float_params(loop.networks[name].unwrapped)
                self.shadow[name] = {k: p.detach().clone() for k, p in params.items()}
                self.updates[name] = 0

    @hookimpl
    def after_optimizer_step(self, loop, network):
        shadow = self.shadow.get(network.name)
        if shadow is None:  # not tracked, or fit has not started (a hand-made step)
            return
        if self._loaded:  # a checkpoint loaded before or after on_fit_start
            self._place(loop)
            shadow = self.shadow[network.name]
        pair = self._pairs.get(network.name)
        if pair is None:
            params = _float_params(network.unwrapped)
            pair = self._pairs[network.name] = (list(shadow.values()), [params[k] for k in shadow])
        averages, weights = pair
        with torch.no_grad():
            torch._foreach_mul_(averages, self.decay)
            torch._foreach_add_(averages, weights, alpha=1.0 - self.decay)
        self.updates[network.name] += 1

    @hookimpl(tryfirst=True)
    def on_eval_start(self, loop):
        # first, so that every other on_eval_start already sees the averages
        if self.evaluate:
            self._swap_in(loop)

    @hookimpl(trylast=True)
    def on_eval_end(self, loop):
        self._swap_out(loop)

    @hookimpl
    def on_exception(self, loop):
        self._swap_out(loop)  # never leave the averages in a model after a failure

    # -- internals ---------------------------------------------------------------

    def _tracked(self, loop) -> list[str]:
        if self.networks is None:
            return list(loop.networks)
        unknown = [n for n in self.networks if n not in loop.networks]
        if unknown:
            raise ValueError(
                f"EMA: no network named {', '.join(map(repr, unknown))}; "
                f"this loop's networks are {', '.join(map(repr, loop.networks))}"
            )
        return list(self.networks)

    def _place(self, loop):
        """Check averages that came from a checkpoint against the networks,
        and move them (saved on the CPU) to where the weights are."""
        for name, saved in self.shadow.items():
            if name not in loop.networks:
                raise ValueError(f"EMA: the checkpoint has an average for network {name!r}, "
                                 f"which this loop does not have ({', '.join(loop.networks)})")
            params = _float_params(loop.networks[name].unwrapped)
            if set(saved) != set(params):
                raise ValueError(
                    f"EMA: the saved average of network {name!r} does not match its "
                    f"parameters (missing {sorted(set(params) - set(saved))[:3]}, "
                    f"unexpected {sorted(set(saved) - set(params))[:3]})"
                )
            self.shadow[name] = {k: saved[k].to(params[k].device, params[k].dtype) for k in params}
        self._loaded = False
        self._pairs = {}

    def _swap_in(self, loop):
        if self._swapped is not None or not self.shadow:
            return
        if self._loaded:
            self._place(loop)
        self._swapped = {}
        with torch.no_grad():
            for name, shadow in self.shadow.items():
                params = _float_params(loop.networks[name].unwrapped)
                self._swapped[name] = {k: params[k].detach().clone() for k in shadow}
                for k, value in shadow.items():
                    params[k].copy_(value)

    def _swap_out(self, loop):
        if self._swapped is None:
            return
        with torch.no_grad():
            for name, saved in self._swapped.items():
                params = _float_params(loop.networks[name].unwrapped)
                for k, value in saved.items():
                    params[k].copy_(value)
        self._swapped = None


def _float_params(module) -> dict[str, torch.nn.Parameter]:
    return {k: p for k, p in module.named_parameters() if p.is_floating_point()}
