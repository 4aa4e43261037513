"""When training fails: NaN losses, exceptions, emergency checkpoints."""

import json

import pytest
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Loop, Network, hookimpl
from hookloop.plugins import Checkpoint, FiniteCheck, Logger, NonFiniteLoss, ProgressBar
from hookloop.trackers import JSONLinesTracker
from hookloop.testing import HookRecorder


class NaNAt:
    """Makes the loss of network ``network`` NaN at batch ``step`` (micro_step,
    the same as the global step without accumulation)."""

    name = "nan_at"

    def __init__(self, step, network="model"):
        self.step, self.network = step, network

    @hookimpl(wrapper=True)
    def compute_loss(self, loop, network):
        loss = yield
        if network.name == self.network and loop.state.micro_step + 1 == self.step:
            return loss * float("nan")
        return loss


def test_a_nan_loss_stops_at_its_step_naming_the_network(tiny_loop):
    loop = tiny_loop([NaNAt(3)])
    with pytest.raises(NonFiniteLoss, match=r"loss of network 'model' is nan at step 3 \(epoch 0\)") as info:
        loop.fit(epochs=1)
    assert info.value.step == 3
    assert loop.state.global_step == 3  # on the CPU: before step 4


def test_a_gan_nan_names_the_discriminator():
    from hookloop.strategies import GAN

    G, D = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    loop = Loop(networks={"generator": Network(G, torch.optim.SGD(G.parameters(), lr=0.1)),
                          "discriminator": Network(D, torch.optim.SGD(D.parameters(), lr=0.1))},
                strategy=GAN(latent_dim=2), block=["progress"], plugins=[NaNAt(2, "discriminator")],
                train_data=DataLoader(TensorDataset(torch.randn(32, 2)), batch_size=8))
    with pytest.raises(NonFiniteLoss, match=r"loss of network 'discriminator' is nan at step 2"):
        loop.fit(epochs=1)


def test_checked_every_n_steps_it_still_names_the_first_bad_step(tiny_loop):
    # what happens on a GPU by default (every 100): losses kept, read together
    loop = tiny_loop([NaNAt(2), FiniteCheck(every=4)])
    with pytest.raises(NonFiniteLoss, match=r"is nan at step 2 \(epoch 0\), found when checking at step 4"):
        loop.fit(epochs=1)


def test_no_checkpoint_is_written_after_a_nan_loss(tiny_loop, tmp_path):
    loop = tiny_loop([NaNAt(2), FiniteCheck(every=100), Checkpoint(dir=tmp_path, every_steps=3,
                                                                   on_exception=True, signals=None)])
    with pytest.raises(NonFiniteLoss, match="is nan at step 2"):
        loop.fit(epochs=1)
    assert list(tmp_path.iterdir()) == []  # the save at step 3 checked first; no emergency save


def test_skip_drops_the_optimizer_step_of_a_nan_batch(tiny_loop):
    seen = []

    class Watch:
        @hookimpl
        def after_step(self, loop):
            seen.append([p.detach().clone() for p in loop.networks["model"].unwrapped.parameters()])

    finite = FiniteCheck(action="skip")
    loop = tiny_loop([NaNAt(3), finite, Watch()])
    loop.fit(epochs=1)
    assert finite.skipped == [(3, "model")]
    assert all(torch.equal(a, b) for a, b in zip(seen[1], seen[2]))  # step 3 changed nothing
    assert not all(torch.equal(a, b) for a, b in zip(seen[2], seen[3]))  # step 4 trained
    assert all(torch.isfinite(p).all() for p in seen[-1])


class Boom:
    name = "boom"

    @hookimpl
    def after_step(self, loop):
        if loop.state.global_step == 3:
            raise RuntimeError("boom")


def test_an_exception_calls_on_exception_closes_bar_and_trackers_and_names_the_plugin(tiny_loop, tmp_path):
    recorder = HookRecorder(hooks=["on_exception", "on_fit_end"])
    bar = ProgressBar(disable=True)
    logger = Logger(every=1, console=False)
    loop = tiny_loop([Boom(), recorder, bar, logger,
                      Checkpoint(dir=tmp_path, every_steps=2, on_exception=True, signals=None)],
                     accelerator=Accelerator(log_with=[JSONLinesTracker("run", tmp_path / "logs")]))
    with pytest.raises(RuntimeError, match=r"^boom\nhookloop: raised in hook 'after_step' of plugin 'boom'"):
        loop.fit(epochs=1)
    assert recorder.names() == ["on_exception"]
    assert bar.bar is None
    assert loop.accelerator.trackers == []  # the loop ended the trackers it had started
    # an emergency checkpoint beside the regular ones; latest still names a regular one
    assert (tmp_path / "latest").read_text().strip() == "step-00000002"
    doc = json.loads((tmp_path / "emergency-step-00000003" / "hookloop.json").read_text())
    assert doc["reason"] == "exception" and doc["loop"]["global_step"] == 3


def test_no_emergency_checkpoint_unless_asked(tiny_loop, tmp_path):
    loop = tiny_loop([Boom(), Checkpoint(dir=tmp_path, every_steps=2, signals=None)])
    with pytest.raises(RuntimeError, match="boom"):
        loop.fit(epochs=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000002"]


def test_the_finite_check_is_a_default_that_can_be_blocked(tiny_loop):
    assert "finite" in tiny_loop().plugins.names()
    loop = tiny_loop([NaNAt(3)], block=["progress", "finite"])
    loop.fit(max_steps=4)  # nobody checks: training goes on
    assert not all(torch.isfinite(p).all() for p in loop.networks["model"].unwrapped.parameters())


def test_accumulation_and_skip(tiny_loop):
    finite = FiniteCheck(action="skip")
    loop = tiny_loop([NaNAt(3), finite], accelerator=Accelerator(gradient_accumulation_steps=2))
    loop.fit(epochs=1)
    # the NaN of micro-step 3 reaches the accumulated gradient: the group's update (2) is dropped
    assert finite.skipped == [(2, "model")]
