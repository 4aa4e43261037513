"""Stop on a NaN or infinite loss (a built-in default), or skip such steps."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from ..markers import hookimpl


class NonFiniteLoss(FloatingPointError):
    """A loss was NaN or infinite. ``network``, ``step`` (the global step
    whose loss it was) and ``value`` say which."""

    def __init__(self, network, step, value, epoch=None, checked_at=None):
        self.network = network
        self.step = step
        self.value = value
        where = f"step {step}" + (f" (epoch {epoch})" if epoch is not None else "")
        late = f", found when checking at step {checked_at}" if checked_at not in (None, step) else ""
        super().__init__(
            f"loss of network {network!r} is {value} at {where}{late}: training stopped "
            "(no checkpoint is written from here on). Lower the learning rate, clip "
            "gradients (GradClip), or check the data; FiniteCheck(action='skip') skips "
            "the optimizer step of such batches instead."
        )


class FiniteCheck:
    """Raise :class:`NonFiniteLoss`, naming the step and the network, when a
    loss is NaN or infinite. A built-in default (block it with
    ``block=["finite"]``).

    Reading a loss value synchronises a GPU, so the check is cheap by design:

    - losses on the CPU are read at once, every step (``loss.item()`` of a
      CPU scalar, ~0.3 µs: no device to wait for), and the error comes
      before the next step;
    - losses on an accelerator are kept (a detached reference, ~0.6 µs per
      step) and checked together, with one device sync, every ``every``
      steps (default 100), at every epoch end, at the end of the fit and
      before every checkpoint: the error then names the first bad step,
      and no checkpoint of a poisoned run is ever written.

    :param every: check every N steps (None: 1 on the CPU, 100 elsewhere).
    :param action: ``"raise"`` (default), or ``"skip"``: on every optimizer
        step, check the gradients (after they are synchronised across
        processes, so every rank decides alike) and, if any is not finite,
        drop them (``grad = None``) so that the optimizer step changes
        nothing; the schedulers still step. Costs one device sync per
        optimizer step. With an fp16 gradient scaler, which already skips
        such steps and adapts its scale from them, ``"skip"`` does nothing.
    """

    name = "finite"
    changes_training = True  # it stops training (or, with action="skip", drops updates)

    def __init__(self, every: int | None = None, action: str = "raise") -> None:
        if action not in ("raise", "skip"):
            raise ValueError(f"FiniteCheck: action must be 'raise' or 'skip', got {action!r}")
        if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
            raise ValueError(f"FiniteCheck: every must be a positive int or None, got {every!r}")
        self.every = every
        self.action = action
        #: ``(global step, network name)`` of every step skipped (``action="skip"``)
        self.skipped: list[tuple[int, str]] = []
        self._pending: list = []
        self._every = every or 1
        self._immediate = False  # read each loss at once (CPU), decided per fit
        if action != "skip":
            # nothing to do after a backward: then no implementation at all (pluggy
            # passes over an attribute that is not a function), so the default
            # per-step path leaves the call out
            vars(self)["after_backward"] = None

    @staticmethod
    def _host_device(loop) -> bool:
        """Whether the run's tensors live in host memory (the CPU), where
        reading a loss waits for nothing."""
        return loop.accelerator.device.type == "cpu"

    @hookimpl
    def on_fit_start(self, loop):
        self._pending = []
        on_cpu = self._host_device(loop)
        if self.every is None:
            self._every = 1 if on_cpu else 100
        self._immediate = self.action == "raise" and self._every == 1 and on_cpu

    @hookimpl(tryfirst=True)
    def after_step(self, loop, loss):
        if self._immediate and type(loss) is torch.Tensor:
            try:  # the common case, kept short: a one-value loss, read at once
                if math.isfinite(loss.item()):
                    return
            except RuntimeError:  # several values: item() refuses them
                pass
        if self.action != "raise":
            return
        step = loop.state.global_step
        losses = loss.items() if isinstance(loss, Mapping) else ((None, loss),)
        if self._immediate:
            for name, value in losses:
                if value is None:
                    continue
                v = value.item() if value.numel() == 1 else _first_bad(value)
                if not math.isfinite(v):
                    raise NonFiniteLoss(_network(loop, name), step, v, loop.state.epoch)
            return
        for name, value in losses:
            if value is not None:
                self._pending.append((step, loop.state.epoch, name, value.detach()))
        if step % self._every == 0:
            self.check(loop)

    @hookimpl
    def on_epoch_end(self, loop):
        self.check(loop)

    @hookimpl
    def on_fit_end(self, loop):
        self.check(loop)

    @hookimpl
    def before_save_checkpoint(self, loop):
        self.check(loop)  # never publish a checkpoint of a run whose loss went NaN

    def check(self, loop) -> None:
        """Check the losses kept since the last check (one device sync);
        raise :class:`NonFiniteLoss` for the first bad one."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        flags = torch.stack([v.isfinite().all() for *_, v in pending])
        if bool(flags.all()):
            return
        i = int((~flags).nonzero()[0])
        step, epoch, name, value = pending[i]
        v = value.item() if value.numel() == 1 else _first_bad(value)
        raise NonFiniteLoss(_network(loop, name), step, v, epoch, checked_at=loop.state.global_step)

    @hookimpl(tryfirst=True)
    def after_backward(self, loop, network):
        if self.action != "skip":
            return
        acc = loop.accelerator
        if not acc.sync_gradients or acc.scaler is not None:
            return
        params = [p for p in network.model.parameters() if p.grad is not None]
        if not params:
            return
        if bool(_total_norm([p.grad for p in params]).isfinite()):
            return
        for p in params:
            p.grad = None  # the optimizer skips parameters without a gradient
        self.skipped.append((loop.state.global_step + 1, network.name))


def _network(loop, name):
    if name is not None:
        return name
    return next(iter(loop.networks)) if len(loop.networks) == 1 else "?"


def _first_bad(value):
    flat = value.detach().reshape(-1)
    bad = (~flat.isfinite()).nonzero()
    return float(flat[bad[0]].item()) if len(bad) else float(flat[0].item())


def _total_norm(grads):
    get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)
    if get_total_norm is not None:
        return get_total_norm(grads, error_if_nonfinite=False)
    return torch.stack([g.detach().norm() for g in grads]).norm()
