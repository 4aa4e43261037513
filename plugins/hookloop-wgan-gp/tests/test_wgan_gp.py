"""hookloop-wgan-gp: the penalty against hand computations on tiny critics,
then inside a GAN loop built with hookloop's kit (``tiny_gan_loop``).

Run after installing: ``pip install ./plugins/hookloop-wgan-gp`` then
``pytest plugins/hookloop-wgan-gp/tests``.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

from hookloop import Network, hookimpl
from hookloop_wgan_gp import WGANGP, gradient_penalty


def linear_critic():
    """D(x) = 3 x0 + 4 x1 + 0.5: its input gradient is (3, 4, 0) everywhere,
    of norm 5, so the penalty is (5 - 1)^2 = 16 whatever the mixing."""
    critic = torch.nn.Linear(3, 1)
    with torch.no_grad():
        critic.weight.copy_(torch.tensor([[3.0, 4.0, 0.0]]))
        critic.bias.fill_(0.5)
    return critic


class Quadratic(torch.nn.Module):
    """D(x) = a/2 ||x||^2: input gradient a x, of norm a ||x||."""

    def __init__(self, a):
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(float(a)))

    def forward(self, x):
        return 0.5 * self.a * (x**2).sum(dim=1, keepdim=True)


REAL = torch.tensor([[2.0, 0.0], [0.0, 2.0]])
FAKE = torch.tensor([[0.0, 0.0], [0.0, -2.0]])


def discriminator_outputs(critic, real, fake):
    """What the GAN strategy gives compute_loss for the discriminator."""
    return {"real": critic(real), "fake": critic(fake), "real_samples": real,
            "fake_samples": fake, "latent": None}


def test_linear_critic_loss_is_the_hand_computed_one():
    critic = linear_critic()
    real = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])  # scores 3.5, 4.5: mean 4
    fake = torch.tensor([[0.0, 0.0, 1.0], [1.0, 1.0, 1.0]])  # scores 0.5, 7.5: mean 4
    plugin = WGANGP(weight=10.0)
    d = Network(critic, name="discriminator")
    loss = plugin.compute_loss(network=d, outputs=discriminator_outputs(critic, real, fake))
    assert loss.item() == 4.0 - 4.0 + 10 * (5 - 1) ** 2 == 160.0
    assert plugin.last_penalty.item() == 16.0
    g = Network(torch.nn.Linear(2, 3), name="generator")
    assert plugin.compute_loss(network=g, outputs={"fake": critic(fake)}).item() == -4.0


def test_quadratic_critic_penalty_and_its_gradient_are_the_hand_computed_ones():
    critic = Quadratic(a=3.0)
    # mixes: 0.25 * (2, 0) + 0.75 * (0, 0) = (0.5, 0) -> gradient norm 1.5
    #        0.5 * (0, 2) + 0.5 * (0, -2)  = (0, 0)   -> gradient norm 0
    penalty = gradient_penalty(critic, REAL, FAKE, epsilon=torch.tensor([0.25, 0.5]))
    assert penalty.item() == pytest.approx(((1.5 - 1) ** 2 + (0 - 1) ** 2) / 2)  # 0.625
    # d/da of mean((a |x| - 1)^2) = mean(2 (a |x| - 1) |x|) = (2 * 0.5 * 0.5 + 0) / 2
    penalty.backward()
    assert critic.a.grad.item() == pytest.approx(0.25)


def test_the_mixing_weights_come_from_torch_s_generator():
    critic = Quadratic(a=1.0)
    torch.manual_seed(7)
    eps = torch.rand(2)
    mix = eps[:, None] * REAL + (1 - eps[:, None]) * FAKE
    expected = ((mix.norm(dim=1) - 1) ** 2).mean()
    torch.manual_seed(7)
    plugin = WGANGP(weight=2.0)
    d = Network(critic, name="discriminator")
    outputs = discriminator_outputs(critic, REAL, FAKE)
    loss = plugin.compute_loss(network=d, outputs=outputs)
    torch.testing.assert_close(plugin.last_penalty, expected)
    torch.testing.assert_close(loss, outputs["fake"].mean() - outputs["real"].mean() + 2.0 * expected)


def test_shapes_must_match():
    with pytest.raises(ValueError, match="differ in shape"):
        gradient_penalty(Quadratic(1.0), REAL, FAKE[:1])


class Capture:
    """Before the discriminator's loss: the RNG state, the outputs and the
    critic's weights; after its backward: its gradients."""

    name = "capture"

    def __init__(self):
        self.first = None

    @hookimpl(tryfirst=True)
    def compute_loss(self, loop, network, outputs):
        if network.name == "discriminator" and self.first is None:
            self.first = {"rng": torch.get_rng_state(), "outputs": outputs,
                          "critic": copy.deepcopy(network.unwrapped)}

    @hookimpl
    def after_backward(self, network):
        if network.name == "discriminator" and "grads" not in self.first:
            self.first["grads"] = [p.grad.clone() for p in network.unwrapped.parameters()]


def test_in_a_gan_loop_the_critic_is_trained_on_this_loss(tiny_gan_loop, hookloop_recorder):
    capture, plugin = Capture(), WGANGP()
    loop = tiny_gan_loop([capture, plugin, hookloop_recorder])
    loop.fit(max_steps=2)

    # the critic's first gradients are those of the loss computed here, independently
    first = capture.first
    critic, out = first["critic"], first["outputs"]
    real, fake = out["real_samples"], out["fake_samples"]
    torch.set_rng_state(first["rng"])
    eps = torch.rand(real.shape[0])[:, None]
    mix = (eps * real + (1 - eps) * fake).requires_grad_(True)
    (grad_x,) = torch.autograd.grad(critic(mix).sum(), mix, create_graph=True)
    expected = critic(fake).mean() - critic(real).mean() + 10 * ((grad_x.norm(dim=1) - 1) ** 2).mean()
    expected_grads = torch.autograd.grad(expected, list(critic.parameters()))
    for got, want in zip(first["grads"], expected_grads):
        torch.testing.assert_close(got, want)

    # the generator's loss is -mean(D(fake)), not the default BCE
    for call in hookloop_recorder.calls_of("after_step"):
        torch.testing.assert_close(call["loss"]["generator"],
                                   -call["outputs"]["generator"]["fake"].mean())


def test_generator_false_leaves_the_generator_to_the_default_loss(tiny_gan_loop, hookloop_recorder):
    tiny_gan_loop([WGANGP(generator=False), hookloop_recorder]).fit(max_steps=1)
    (call,) = hookloop_recorder.calls_of("after_step")
    fake = call["outputs"]["generator"]["fake"]
    torch.testing.assert_close(call["loss"]["generator"],
                               F.binary_cross_entropy_with_logits(fake, torch.ones_like(fake)))


def test_installed_it_is_switched_on_by_name_with_options(tiny_gan_loop):
    loop = tiny_gan_loop([("wgan-gp", {"weight": 5.0})])
    plugin = loop.plugins.get("wgan-gp")
    assert isinstance(plugin, WGANGP) and plugin.weight == 5.0
    assert "wgan-gp" not in tiny_gan_loop().plugins.names()  # installed is not switched on
