"""Every param group's learning rate (and momentum, weight decay) to the trackers, as
Lightning's ``LearningRateMonitor`` names them."""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..markers import hookimpl

if TYPE_CHECKING:  # names for the annotations only
    from ..network import Network
    from ..protocols import LoopLike


class LearningRateMonitor:
    """Log the learning rate of every param group of every optimizer with
    :meth:`Loop.log <hookloop.Loop.log>`, under Lightning's names:
    ``lr-Adam`` for an optimizer with one param group; ``lr-Adam/pg1``,
    ``lr-Adam/pg2``, ... with several (a group's ``"name"`` key replaces
    ``pg<i>``); a second optimizer of the same class is ``lr-Adam-1``.
    ``name_by="network"`` names them after the networks instead
    (``lr-generator``, ``lr-discriminator/pg2``), which tells a GAN's two
    ``Adam`` apart at a glance.

    ``logging_interval="step"`` logs at every ``every``-th optimizer update
    of each network, just before it is made (``before_optimizer_step``): at
    ``step=N`` the rate that update ``N`` uses (hookloop logs every value of
    an update at its number, counted from 1; Lightning logs it at ``N - 1``).
    ``"epoch"`` logs once at every epoch start. ``None`` is ``"step"``
    (hookloop steps every scheduler at every update).

    :param log_momentum: also ``<name>-momentum``: ``betas[0]`` for Adam-like
        optimizers, else the group's ``momentum`` (0 without).
    :param log_weight_decay: also ``<name>-weight_decay``.
    :param log_key_prefix: put before every key (``"optim/"``: ``optim/lr-Adam``).
    :param every: log every N updates (``"step"`` only).

    Every value logged is also appended to :attr:`lrs` (``{name: [lr, ...]}``),
    whether trackers are configured or not. Reading a param group costs no
    device sync. Without any tracker (``Accelerator(log_with=...)``) nothing
    is written, and ``on_fit_start`` warns once.
    """

    name = "lr-monitor"
    changes_training = False

    def __init__(self, logging_interval: str | None = "step", log_momentum: bool = False,
                 log_weight_decay: bool = False, log_key_prefix: str = "", every: int = 1,
                 name_by: str = "optimizer") -> None:
        if logging_interval not in (None, "step", "epoch"):
            raise ValueError(f"LearningRateMonitor: logging_interval must be 'step', 'epoch' or None, "
                             f"got {logging_interval!r}")
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"LearningRateMonitor: every must be a positive int, got {every!r}")
        if name_by not in ("optimizer", "network"):
            raise ValueError(f"LearningRateMonitor: name_by must be 'optimizer' or 'network', got {name_by!r}")
        self.logging_interval = logging_interval or "step"
        self.log_momentum = log_momentum
        self.log_weight_decay = log_weight_decay
        self.log_key_prefix = log_key_prefix or ""
        self.every = every
        self.name_by = name_by
        #: every learning rate logged, by name
        self.lrs: dict[str, list[float]] = {}
        self._bases: dict[str, str] = {}  # network -> "lr-Adam", "lr-Adam-1", ...
        self._keys: dict[str, tuple[int, list[str]]] = {}  # network -> (groups seen, keys per group)

    @hookimpl
    def on_fit_start(self, loop: LoopLike) -> None:
        self._bases = {}
        self._keys = {}
        seen: dict[type, int] = defaultdict(int)
        for name, network in loop.networks.items():
            if network.optimizer is None:
                continue
            optimizer = _unwrap(network.optimizer)
            if self.name_by == "network":
                self._bases[name] = f"lr-{name}"
                continue
            cls = type(optimizer)
            seen[cls] += 1
            base = f"lr-{cls.__name__}"
            self._bases[name] = base if seen[cls] == 1 else f"{base}-{seen[cls] - 1}"
        acc = loop.accelerator
        if acc.is_main_process and not acc.trackers and not acc.log_with:
            warnings.warn(
                "LearningRateMonitor: the accelerator has no tracker (Accelerator(log_with=...)), "
                "so the learning rates are only kept in lr_monitor.lrs",
                RuntimeWarning, stacklevel=2,
            )

    @hookimpl
    def before_optimizer_step(self, loop: LoopLike, network: Network) -> None:
        if self.logging_interval == "step" and not loop.state.global_step % self.every:
            values = self._stats(network)
            if values:
                loop.log(values)

    @hookimpl
    def on_epoch_start(self, loop: LoopLike) -> None:
        if self.logging_interval == "epoch":
            values: dict[str, float] = {}
            for network in loop.networks.values():
                values.update(self._stats(network))
            if values:
                loop.log(values)

    def _stats(self, network: Network) -> dict[str, float]:
        base = self._bases.get(network.name)
        if base is None:
            return {}
        optimizer = _unwrap(network.optimizer)
        groups = optimizer.param_groups
        keys = self._keys.get(network.name)
        if keys is None or keys[0] != len(groups):  # a param group was added: name again
            keys = self._keys[network.name] = (len(groups), _group_keys(self.log_key_prefix + base, groups))
        betas = "betas" in optimizer.defaults
        values: dict[str, float] = {}
        for key, group in zip(keys[1], groups):
            values[key] = group["lr"]
            self.lrs.setdefault(key, []).append(group["lr"])
            if self.log_momentum:
                values[f"{key}-momentum"] = group["betas"][0] if betas else group.get("momentum", 0)
            if self.log_weight_decay:
                values[f"{key}-weight_decay"] = group.get("weight_decay", 0)
        return values


def _unwrap(optimizer: Any) -> Any:
    """The user's optimizer inside Accelerate's ``AcceleratedOptimizer``."""
    return getattr(optimizer, "optimizer", optimizer)


def _group_keys(base: str, groups: Sequence[Mapping[str, Any]]) -> list[str]:
    """Lightning's names: ``base`` for one unnamed group, ``base/<name>`` for a
    named one, ``base/pg1``, ``base/pg2``, ... for several."""
    if len(groups) == 1:
        name = groups[0].get("name")
        return [f"{base}/{name}" if name else base]
    return [f"{base}/{g.get('name', f'pg{i}')}" for i, g in enumerate(groups, start=1)]
