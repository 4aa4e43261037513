"""Exponential moving average of weights, per network, as a hookloop plugin.

::

    loop = Loop(..., plugins=["ema"])                       # decay 0.999, every network
    loop = Loop(..., plugins=[("ema", {"decay": 0.99, "networks": ["generator"]})])
    # diffusers' warm-up schedule (EMAModel(..., use_ema_warmup=True, power=3/4))
    loop = Loop(..., plugins=[("ema", {"decay": 0.9999, "use_ema_warmup": True, "power": 3 / 4})])

After every optimizer step of a tracked network, its average moves towards
the new weights::

    average = decay * average + (1 - decay) * weights

starting from the weights at the start of training. With
``use_ema_warmup=True`` the decay of each step follows
``diffusers.training_utils.EMAModel``'s warm-up schedule instead, and the
update is computed as diffusers computes it (see :class:`EMA`). Evaluation
(``loop.evaluate()``, and the evaluation at every epoch end) runs with the
averaged weights; training continues from the trained ones. The averages,
step counts and schedule are plugin state (:meth:`EMA.state_dict`): a
checkpoint plugin that saves plugin state keeps them, and a resumed run
continues them.
"""

from __future__ import annotations

import contextlib

import torch

from hookloop import hookimpl

__version__ = "0.2.0"

__all__ = ["EMA"]


class EMA:
    """Keep an exponential moving average of each tracked network's
    parameters, and evaluate with it.

    :param decay: in ``[0, 1)``; the weight of the past. ``0.999`` averages
        over roughly the last 1000 steps. With ``use_ema_warmup``, the largest
        decay the schedule reaches.
    :param networks: names of the networks to average (default: every network
        of the loop; for a GAN, ``["generator"]`` is the usual choice).
    :param evaluate: swap the averages in for evaluation (``on_eval_start``)
        and the trained weights back (``on_eval_end``). With ``False`` the
        averages are only kept (read them with :meth:`average` or
        :meth:`applied`).
    :param use_ema_warmup: follow ``diffusers.training_utils.EMAModel``'s
        warm-up schedule (:meth:`get_decay`): at optimizer step ``n`` of a
        network (counted from 1, per network), with
        ``t = n - update_after_step - 1``, the decay is ``0`` while ``t <= 0``
        (the average takes the weights) and then
        ``max(min_decay, min(decay, 1 - (1 + t / inv_gamma) ** -power))``; the
        update is diffusers' ``average -= (1 - decay) * (average - weights)``,
        in the parameters' dtype, and parameters that do not require grad are
        copied, not averaged. The averages equal ``EMAModel(...).step(...)``'s
        bit for bit. ``False`` (the default): the constant ``decay`` and
        ``average = decay * average + (1 - decay) * weights``, as in
        hookloop-ema 0.1 (diffusers' own ``use_ema_warmup=False`` schedule,
        ``(1 + t) / (10 + t)``, is *not* this one).
    :param inv_gamma: ``> 0``; the warm-up's time scale (diffusers' default 1).
    :param power: ``> 0``; the warm-up's exponent: ``2/3`` (diffusers' default)
        reaches 0.999 at about 31.6k steps, ``3/4`` at about 10k.
    :param min_decay: in ``[0, decay]``; the smallest decay once the warm-up
        has started (as in diffusers, not applied to the steps before).
    :param update_after_step: a whole number ``>= 0``; the average takes the
        weights (decay 0) for the first steps: with ``use_ema_warmup``, the
        first ``update_after_step + 1`` (diffusers' count); without, the
        first ``update_after_step``.

    From diffusers: ``EMAModel(unet.parameters(), decay=d, use_ema_warmup=True,
    inv_gamma=g, power=p, min_decay=m, update_after_step=k)`` is
    ``EMA(decay=d, use_ema_warmup=True, inv_gamma=g, power=p, min_decay=m,
    update_after_step=k)``; drop the ``ema.step(...)`` call (the plugin steps
    after every optimizer step) and ``store``/``copy_to``/``restore`` around
    evaluation (the plugin swaps the averages in).

    Only floating-point parameters are averaged; buffers (batch-norm running
    statistics) are left as training made them. Every process keeps the same
    averages (data-parallel parameters are identical after each step).
    """

    name = "ema"
    changes_training = True  # evaluates (and can export) other weights

    def __init__(self, decay: float = 0.999, networks=None, evaluate: bool = True, *,
                 use_ema_warmup: bool = False, inv_gamma: float = 1.0, power: float = 2 / 3,
                 min_decay: float = 0.0, update_after_step: int = 0):
        self._configure(decay=decay, use_ema_warmup=use_ema_warmup, inv_gamma=inv_gamma,
                        power=power, min_decay=min_decay, update_after_step=update_after_step)
        if isinstance(networks, str):
            networks = [networks]
        self.networks = list(networks) if networks is not None else None
        self.evaluate = evaluate
        #: network name -> {parameter name: averaged tensor}
        self.shadow: dict[str, dict[str, torch.Tensor]] = {}
        #: network name -> optimizer steps averaged so far (diffusers' ``optimization_step``)
        self.updates: dict[str, int] = {}
        #: network name -> the decay of its last update (diffusers' ``cur_decay_value``)
        self.current_decay: dict[str, float] = {}
        self._swapped: dict | None = None
        self._loaded = False  # averages came from a checkpoint: check and place them
        self._pairs: dict = {}  # network -> (averages, parameters), cached for the fit

    #: the schedule's arguments, in state_dict, with their defaults (a checkpoint
    #: of hookloop-ema 0.1 has none of them but "decay": a constant decay)
    SCHEDULE = {"use_ema_warmup": False, "inv_gamma": 1.0, "power": 2 / 3,
                "min_decay": 0.0, "update_after_step": 0}

    def _configure(self, *, decay, use_ema_warmup, inv_gamma, power, min_decay, update_after_step):
        """Check and set the schedule's arguments (from ``__init__`` or a checkpoint)."""
        if not (_is_number(decay) and 0.0 <= decay < 1.0):
            raise ValueError(f"EMA: decay must be a number in [0, 1), got {decay!r}")
        if not isinstance(use_ema_warmup, bool):
            raise ValueError(f"EMA: use_ema_warmup must be True or False, got {use_ema_warmup!r}")
        if not (_is_number(inv_gamma) and inv_gamma > 0):
            raise ValueError(f"EMA: inv_gamma must be a number > 0 (the warm-up's time scale; "
                             f"diffusers' default is 1.0), got {inv_gamma!r}")
        if not (_is_number(power) and power > 0):
            raise ValueError(f"EMA: power must be a number > 0 (the warm-up's exponent; diffusers "
                             f"uses 2/3, or 3/4 for shorter runs), got {power!r}")
        if not (_is_number(min_decay) and 0.0 <= min_decay <= decay):
            raise ValueError(f"EMA: min_decay must be a number in [0, decay] = [0, {float(decay)!r}], "
                             f"got {min_decay!r}")
        if isinstance(update_after_step, bool) or not isinstance(update_after_step, int) \
                or update_after_step < 0:
            raise ValueError(f"EMA: update_after_step must be a whole number >= 0, "
                             f"got {update_after_step!r}")
        self.decay = float(decay)
        self.use_ema_warmup = use_ema_warmup
        # kept as given (an int stays an int), as diffusers keeps them: the same arithmetic
        self.inv_gamma = inv_gamma
        self.power = power
        self.min_decay = min_decay
        self.update_after_step = update_after_step

    def get_decay(self, optimization_step: int) -> float:
        """The decay of a network's update number ``optimization_step``
        (counted from 1). With ``use_ema_warmup``, exactly
        ``diffusers.training_utils.EMAModel.get_decay`` with the same
        arguments; without, ``decay`` (``0`` for the first
        ``update_after_step`` steps)."""
        if not self.use_ema_warmup:
            return 0.0 if optimization_step <= self.update_after_step else self.decay
        # diffusers' EMAModel.get_decay, expression for expression
        step = max(0, optimization_step - self.update_after_step - 1)
        if step <= 0:
            return 0.0
        cur_decay_value = 1 - (1 + step / self.inv_gamma) ** -self.power
        cur_decay_value = min(cur_decay_value, self.decay)
        cur_decay_value = max(cur_decay_value, self.min_decay)
        return cur_decay_value

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
        """The averages, step counts and schedule, for a checkpoint (tensors on CPU)."""
        return {
            "decay": self.decay,
            **{key: getattr(self, key) for key in self.SCHEDULE},
            "updates": dict(self.updates),
            "shadow": {
                net: {k: v.detach().to("cpu", copy=True) for k, v in params.items()}
                for net, params in self.shadow.items()
            },
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output (before or after ``on_fit_start``:
        averages already loaded are kept, not reset to the current weights).
        The schedule comes back with them (a checkpoint without one, from
        hookloop-ema 0.1, had the constant decay)."""
        self._configure(decay=state["decay"],
                        **{key: state.get(key, default) for key, default in self.SCHEDULE.items()})
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
        step = self.updates[network.name] + 1  # diffusers increments before get_decay
        decay = self.get_decay(step)
        with torch.no_grad():
            if self.use_ema_warmup:
                _diffusers_update(averages, weights, decay)
            else:  # hookloop-ema 0.1's update, bit for bit
                torch._foreach_mul_(averages, decay)
                torch._foreach_add_(averages, weights, alpha=1.0 - decay)
        self.updates[network.name] = step
        self.current_decay[network.name] = decay

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


def _diffusers_update(averages, weights, decay):
    """``EMAModel.step``'s update (``foreach=False``): for each parameter that
    requires grad ``average.sub_((1 - decay) * (average - weights))``, in its
    dtype; the others copied. The same three rounded operations, batched."""
    one_minus_decay = 1 - decay
    trained = [(a, w) for a, w in zip(averages, weights) if w.requires_grad]
    if len(trained) < len(averages):
        for a, w in zip(averages, weights):
            if not w.requires_grad:
                a.copy_(w)
    if trained:
        avg, cur = [a for a, _ in trained], [w for _, w in trained]
        diff = torch._foreach_sub(avg, cur)
        # out of place: on the CPU the in-place _foreach_mul_ rounds the scalar to a
        # bfloat16/float16 tensor's dtype first, and differs from ``scalar * tensor``
        diff = torch._foreach_mul(diff, one_minus_decay)
        torch._foreach_sub_(avg, diff)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _float_params(module) -> dict[str, torch.nn.Parameter]:
    return {k: p for k, p in module.named_parameters() if p.is_floating_point()}
