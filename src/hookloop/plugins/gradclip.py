"""Gradient clipping, per network, on synchronised steps only."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ..markers import hookimpl

if TYPE_CHECKING:  # names for the annotations only
    from ..network import Network
    from ..protocols import LoopLike


class GradClip:
    """Clip each network's gradients after its backward pass.

    ``GradClip(max_norm=1.0)`` rescales so that the global norm is at most
    ``max_norm`` (``accelerator.clip_grad_norm_``, which also unscales fp16
    gradients first) and records the pre-clip norm in ``network.grad_norm``
    for logging. ``GradClip(max_value=0.5)`` clamps each gradient element.

    Clipping happens only where ``accelerator.sync_gradients`` is true: under
    gradient accumulation the intermediate gradients are partial and
    rank-local, and clipping them would change the result.

    It also remembers, for free, the first updates whose gradient norm was
    NaN or infinite (:meth:`first_nonfinite_update`): each norm is kept as
    the tensor it is (no device sync) and the kept ones are checked
    together every 256 updates or when asked, with one sync. A refused
    checkpoint (:class:`hookloop.checkpointing.NonFiniteCheckpoint`) names
    that update. Not with an fp16 gradient scaler, whose skipped overflow
    steps have infinite norms by design.

    :param networks: names of the networks to clip (default: all).
    """

    name = "gradclip"
    changes_training = True
    #: norms kept before they are checked together (one sync each time)
    check_every = 256
    #: non-finite updates remembered
    remember = 16

    def __init__(self, max_norm: float | None = None, max_value: float | None = None,
                 norm_type: float = 2.0, networks: Iterable[str] | None = None) -> None:
        if (max_norm is None) == (max_value is None):
            raise ValueError("GradClip takes exactly one of max_norm=... or max_value=...")
        limit = max_norm if max_norm is not None else max_value
        if limit is None or not limit > 0:  # (never None: one of the two is given)
            raise ValueError(f"GradClip: the limit must be positive, got {limit!r}")
        self.max_norm = max_norm
        self.max_value = max_value
        self.norm_type = norm_type
        self.networks = set(networks) if networks is not None else None
        #: ``(update, network, norm)`` of the first updates whose gradient norm
        #: was not finite (at most ``remember``), once checked
        self.nonfinite: list[tuple[int, str, float]] = []
        self._norms: list[tuple[int, str, Any]] = []  # (update, network, 0-d norm tensor), not checked yet

    @hookimpl
    def after_backward(self, loop: LoopLike, network: Network) -> None:
        if self.networks is not None and network.name not in self.networks:
            return
        accelerator = loop.accelerator
        if not accelerator.sync_gradients:
            return
        if self.max_norm is not None:
            norm = network.grad_norm = accelerator.clip_grad_norm_(
                network.model.parameters(), self.max_norm, norm_type=self.norm_type
            )
            if accelerator.scaler is None and len(self.nonfinite) < self.remember:
                self._norms.append((loop.state.global_step + 1, network.name, norm))
                if len(self._norms) >= self.check_every:
                    self._check()
        else:
            accelerator.clip_grad_value_(network.model.parameters(), self.max_value)

    @hookimpl
    def first_nonfinite_update(self, after: int) -> tuple[int, str, str] | None:
        """``(update, network, what)`` of the first update after ``after``
        whose gradient norm was NaN or infinite, or None (checks the kept
        norms: one device sync)."""
        self._check()
        for update, network, value in self.nonfinite:
            if update > after:
                return update, network, f"GradClip: the gradient norm of network {network!r} was {value}"
        return None

    def _check(self) -> None:
        import torch

        pending, self._norms = self._norms, []
        norms = [(u, n, t) for u, n, t in pending if isinstance(t, torch.Tensor)]
        if not norms:
            return
        by_device: dict[torch.device, list[int]] = {}
        for i, (*_, t) in enumerate(norms):
            by_device.setdefault(t.device, []).append(i)
        bad: list[int] = []
        for index in by_device.values():
            ok = torch.stack([norms[i][2].detach().reshape(()).float() for i in index]).isfinite()
            if not bool(ok.all()):  # one sync per device
                bad += [index[j] for j in (~ok).nonzero().flatten().tolist()]
        for i in sorted(bad)[: max(0, self.remember - len(self.nonfinite))]:
            update, network, value = norms[i]
            self.nonfinite.append((update, network, float(value)))
