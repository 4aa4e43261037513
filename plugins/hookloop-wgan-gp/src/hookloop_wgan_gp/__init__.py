"""WGAN-GP (Gulrajani et al., 2017, "Improved Training of Wasserstein GANs")
for hookloop's GAN strategy, as one ``compute_loss`` implementation.

::

    loop = Loop(networks={"generator": Network(G, opt_g), "discriminator": Network(D, opt_d)},
                strategy=GAN(latent_dim=64, n_critic=5), train_data=data,
                plugins=["wgan-gp"])

The discriminator is a critic (one unbounded score per sample); its loss is::

    mean(D(fake)) - mean(D(real)) + weight * mean((||grad_x D(x_mix)||_2 - center)^2)
    x_mix = eps * real + (1 - eps) * fake,   eps ~ U[0, 1], one per sample

and the generator's is ``-mean(D(fake))``. Everything comes from the hook's
arguments (see :class:`hookloop.strategies.GAN` for what ``outputs`` holds),
so the plugin implements nothing but ``compute_loss``.
"""

from __future__ import annotations

import torch

from hookloop import hookimpl

__version__ = "0.1.0"

__all__ = ["WGANGP", "gradient_penalty"]


def gradient_penalty(critic, real, fake, epsilon=None, center=1.0):
    """``mean((||grad_x critic(x)||_2 - center)^2)`` over the points ``x``
    between ``real`` and ``fake`` samples.

    :param critic: a module mapping a batch of samples to one score per sample.
    :param real: real samples, batch first.
    :param fake: generated samples, same shape (detached from the generator).
    :param epsilon: the mixing weights, one per sample (shape ``(N,)`` or
        broadcastable to the samples); default ``U[0, 1)`` drawn from torch's
        global generator on the samples' device.
    :param center: the target gradient norm (1 in the paper).
    :return: a scalar tensor with a graph to the critic's parameters (it was
        computed with ``create_graph=True``), ready for ``backward``.
    """
    if real.shape != fake.shape:
        raise ValueError(f"gradient_penalty: real {tuple(real.shape)} and fake "
                         f"{tuple(fake.shape)} samples differ in shape")
    n = real.shape[0]
    if epsilon is None:
        epsilon = torch.rand(n, device=real.device, dtype=real.dtype)
    epsilon = epsilon.reshape(n, *([1] * (real.dim() - 1))).to(real.dtype)
    mix = (epsilon * real.detach() + (1 - epsilon) * fake.detach()).requires_grad_(True)
    scores = critic(mix)
    (grad,) = torch.autograd.grad(scores.sum(), mix, create_graph=True)
    norms = grad.reshape(n, -1).norm(2, dim=1)
    return ((norms - center) ** 2).mean()


class WGANGP:
    """Wasserstein losses with a gradient penalty, for
    :class:`hookloop.strategies.GAN`.

    :param weight: the penalty's weight (lambda; 10 in the paper).
    :param center: the target gradient norm (1 in the paper).
    :param generator: also give the generator its Wasserstein loss
        ``-mean(D(fake))`` (default). With ``False`` the generator keeps the
        next ``compute_loss`` implementation's loss (the strategy's default).

    The paper trains the critic several times per generator step:
    ``GAN(..., n_critic=5)``. Its critic has no batch normalisation (the
    penalty is per sample). After each discriminator loss,
    ``self.last_penalty`` holds the penalty (a detached tensor: read it with
    ``.item()`` every N steps, not every step).
    """

    name = "wgan-gp"
    changes_training = True  # the loss

    def __init__(self, weight: float = 10.0, center: float = 1.0, generator: bool = True):
        if not weight >= 0:
            raise ValueError(f"WGANGP: weight must be >= 0, got {weight!r}")
        self.weight = weight
        self.center = center
        self.generator = generator
        self.last_penalty = None

    @hookimpl
    def compute_loss(self, network, outputs):
        if network.name == "discriminator":
            penalty = gradient_penalty(network.model, outputs["real_samples"],
                                       outputs["fake_samples"], center=self.center)
            self.last_penalty = penalty.detach()
            return outputs["fake"].mean() - outputs["real"].mean() + self.weight * penalty
        if network.name == "generator" and self.generator:
            return -outputs["fake"].mean()
        return None  # another network, or the generator left to the default loss
