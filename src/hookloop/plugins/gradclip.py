"""Gradient clipping, per network, on synchronised steps only."""

from ..markers import hookimpl


class GradClip:
    """Clip each network's gradients after its backward pass.

    ``GradClip(max_norm=1.0)`` rescales so that the global norm is at most
    ``max_norm`` (``accelerator.clip_grad_norm_``, which also unscales fp16
    gradients first) and records the pre-clip norm in ``network.grad_norm``
    for logging. ``GradClip(max_value=0.5)`` clamps each gradient element.

    Clipping happens only where ``accelerator.sync_gradients`` is true: under
    gradient accumulation the intermediate gradients are partial and
    rank-local, and clipping them would change the result.

    :param networks: names of the networks to clip (default: all).
    """

    name = "gradclip"

    def __init__(self, max_norm=None, max_value=None, norm_type=2.0, networks=None):
        if (max_norm is None) == (max_value is None):
            raise ValueError("GradClip takes exactly one of max_norm=... or max_value=...")
        limit = max_norm if max_norm is not None else max_value
        if not limit > 0:
            raise ValueError(f"GradClip: the limit must be positive, got {limit!r}")
        self.max_norm = max_norm
        self.max_value = max_value
        self.norm_type = norm_type
        self.networks = set(networks) if networks is not None else None

    @hookimpl
    def after_backward(self, loop, network):
        if self.networks is not None and network.name not in self.networks:
            return
        accelerator = loop.accelerator
        if not accelerator.sync_gradients:
            return
        if self.max_norm is not None:
            network.grad_norm = accelerator.clip_grad_norm_(
                network.model.parameters(), self.max_norm, norm_type=self.norm_type
            )
        else:
            accelerator.clip_grad_value_(network.model.parameters(), self.max_value)
