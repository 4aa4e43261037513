"""A step of the user's own where one backward fills two networks' gradients
(an encoder and a decoder, each its own Network and optimizer, one loss):
every per-network plugin sees both networks, and clipping both trains bit for
bit like the hand-written Accelerate loop that clips both."""

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

from hookloop import NOT_MEASURED, Loop, Network, hookimpl
from hookloop.plugins import GradClip
from hookloop.strategy import StepOutput, Strategy, backward, loss_and_backward, update
from hookloop.testing import HookRecorder

MAX_NORM = 0.05  # small: every update clips both networks


class EncoderDecoder(Strategy):
    """One loss through the decoder and the encoder; the decoder's
    loss_and_backward fills both networks' gradients."""

    name = "encoder-decoder"
    network_names = ("encoder", "decoder")

    @hookimpl(trylast=True)
    def training_step(self, loop, batch):
        E, D = loop.networks["encoder"], loop.networks["decoder"]
        inputs, _ = batch
        with loop.accumulate(E.model, D.model):
            outputs = D.model(E.model(inputs))
            loss = loss_and_backward(loop, D, batch, outputs)
            update(loop, E)
            update(loop, D)
        return StepOutput(outputs, loss)

    @hookimpl(trylast=True)
    def compute_loss(self, batch, outputs):
        return F.cross_entropy(outputs, batch[1])


class BareBackward(EncoderDecoder):
    """The same step with the kit's bare backward: no loss_and_backward at all."""

    name = "bare-backward"

    @hookimpl(trylast=True)
    def training_step(self, loop, batch):
        E, D = loop.networks["encoder"], loop.networks["decoder"]
        inputs, targets = batch
        outputs = D.model(E.model(inputs))
        loss = F.cross_entropy(outputs, targets)
        backward(loop, loss)
        update(loop, E)
        update(loop, D)
        return StepOutput(outputs, loss)


def data():
    torch.manual_seed(0)
    x, y = torch.randn(96, 6), torch.randint(0, 3, (96,))
    return x, y


def networks():
    torch.manual_seed(1)
    encoder = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU())
    decoder = torch.nn.Linear(16, 3)
    return encoder, decoder


def by_hand(epochs=2):
    """The hand-written Accelerate loop: one backward, both networks clipped."""
    x, y = data()
    encoder, decoder = networks()
    acc = Accelerator(cpu=True)
    opt_e = torch.optim.SGD(encoder.parameters(), lr=0.5)
    opt_d = torch.optim.SGD(decoder.parameters(), lr=0.5)
    loader = DataLoader(TensorDataset(x, y), batch_size=16)
    encoder, decoder, opt_e, opt_d, loader = acc.prepare(encoder, decoder, opt_e, opt_d, loader)
    for _ in range(epochs):
        for inputs, targets in loader:
            loss = F.cross_entropy(decoder(encoder(inputs)), targets)
            acc.backward(loss)
            acc.clip_grad_norm_(encoder.parameters(), MAX_NORM)
            acc.clip_grad_norm_(decoder.parameters(), MAX_NORM)
            opt_e.step()
            opt_d.step()
            opt_e.zero_grad()
            opt_d.zero_grad()
    return [p.detach().clone() for p in [*encoder.parameters(), *decoder.parameters()]]


def by_loop(strategy, plugins, epochs=2):
    x, y = data()
    encoder, decoder = networks()
    loop = Loop(networks={"encoder": Network(encoder, torch.optim.SGD(encoder.parameters(), lr=0.5)),
                          "decoder": Network(decoder, torch.optim.SGD(decoder.parameters(), lr=0.5))},
                strategy=strategy, train_data=DataLoader(TensorDataset(x, y), batch_size=16),
                plugins=plugins, accelerator=Accelerator(cpu=True), block=["progress"])
    loop.fit(epochs=epochs)
    return loop, [p.detach().clone() for p in [*encoder.parameters(), *decoder.parameters()]]


def test_gradclip_clips_both_networks_of_one_backward_bit_for_bit_like_the_hand_written_loop():
    reference = by_hand()
    loop, params = by_loop(EncoderDecoder(), [GradClip(max_norm=MAX_NORM)])
    assert all(torch.equal(a, b) for a, b in zip(params, reference))
    for name in ("encoder", "decoder"):  # both measured: the encoder is no longer skipped
        assert loop.networks[name].grad_norm is not NOT_MEASURED, name
        assert float(loop.networks[name].grad_norm) > MAX_NORM


def test_after_backward_fires_once_per_updated_network_before_its_update():
    recorder = HookRecorder(hooks=["after_backward", "before_optimizer_step"])
    by_loop(EncoderDecoder(), [recorder], epochs=1)
    calls = [(c.hook, c.kwargs["network"].name) for c in recorder.calls]
    # per batch: the decoder's right after its backward, the encoder's at its update
    batch = [("after_backward", "decoder"), ("after_backward", "encoder"),
             ("before_optimizer_step", "encoder"), ("before_optimizer_step", "decoder")]
    assert calls == batch * 6


def test_a_bare_backward_still_gives_each_network_its_after_backward_and_clipping():
    reference = by_hand()
    loop, params = by_loop(BareBackward(), [GradClip(max_norm=MAX_NORM)])
    assert all(torch.equal(a, b) for a, b in zip(params, reference))
    assert loop.networks["encoder"].grad_norm is not NOT_MEASURED
