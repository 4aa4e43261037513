"""A built-in default answers a *firstresult* hook only when no plugin does:
a user's ``trylast`` ``compute_loss`` or ``training_step`` comes before the
default loss and the strategy's step, with pluggy's privates and without
(``HOOKLOOP_PLUGGY_PRIVATES=0``), and a wrapper of the hook gets the result
that trains."""

import contextlib

import pluggy
import pluggy._manager
import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

from handwritten import train_by_hand
from hookloop import Loop, _pluggy, hookimpl
from hookloop import manager as plugin_manager
from hookloop.strategy import StepOutput, update
from hookloop.testing import registered, reset_accelerate, tiny_gan_loop, tiny_loop

EPOCHS = 2

#: each test runs with pluggy's privates (the generated hook callers) and without (pluggy's callers)
PRIVATES = pytest.mark.parametrize("privates", ["1", "0"], ids=["privates", "no-privates"])


def smoothed(logits, targets):
    """The loss the user's plugins train with: not the default cross-entropy."""
    return F.cross_entropy(logits, targets, label_smoothing=0.2)


def doubled(loss_fn):
    return lambda logits, targets: 2 * loss_fn(logits, targets)


def job():
    set_seed(0)
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    return model, optimizer, data, torch.optim.lr_scheduler.StepLR(optimizer, step_size=3)


def by_hand(loss_fn):
    """The parameters after the hand-written Accelerate loop with ``loss_fn``."""
    reset_accelerate()
    model, optimizer, data, scheduler = job()
    train_by_hand(Accelerator(), model, optimizer, data, scheduler, EPOCHS, loss_fn)
    return [p.detach().clone() for p in model.parameters()]


def by_loop(plugins=(), added=()):
    """The loop and its parameters after fit: ``plugins`` given to ``Loop``,
    ``added`` registered after it was built (``hookloop.testing.registered``)."""
    reset_accelerate()
    model, optimizer, data, scheduler = job()
    loop = Loop(model=model, optimizer=optimizer, scheduler=scheduler, train_data=data,
                plugins=list(plugins), block=["progress"])
    with contextlib.ExitStack() as stack:
        for plugin in added:
            stack.enter_context(registered(loop, plugin))
        loop.fit(epochs=EPOCHS)
    return loop, [p.detach().clone() for p in model.parameters()]


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def use_privates(monkeypatch, privates):
    monkeypatch.setenv(_pluggy.ENV, privates)
    assert _pluggy.status()["direct_calls"] is (privates == "1")


class SmoothedLoss:
    """The loss to train with unless another plugin answers (``trylast``)."""

    @hookimpl(trylast=True)
    def compute_loss(self, batch, outputs):
        return smoothed(outputs, batch[1])


class Doubling:
    """A wrapper of ``compute_loss``: doubles the loss it gets."""

    @hookimpl(wrapper=True)
    def compute_loss(self):
        loss = yield
        return 2 * loss


class SmoothedStep:
    """The whole step, ``trylast``: forward, the smoothed loss, backward, update."""

    @hookimpl(trylast=True)
    def training_step(self, loop, batch):
        network = loop.networks["model"]
        with loop.accumulate(network.model):
            outputs = network.model(batch[0])
            loss = smoothed(outputs, batch[1])
            loop.accelerator.backward(loss)
            update(loop, network)
        return StepOutput(outputs, loss)


@PRIVATES
def test_a_users_trylast_loss_answers_before_the_default_loss(monkeypatch, privates):
    use_privates(monkeypatch, privates)
    loop, got = by_loop([SmoothedLoss()])
    assert isinstance(loop.hook.compute_loss, pluggy.HookCaller) is (privates == "0")
    assert same(got, by_hand(smoothed))
    assert not same(got, by_hand(F.cross_entropy))  # what the default loss trains
    impls = [i.plugin_name for i in reversed(loop.plugins.pm.hook.compute_loss.get_hookimpls())]
    assert impls == ["SmoothedLoss", "loss"]  # called first first: the default last


@PRIVATES
def test_a_users_trylast_training_step_replaces_the_strategys(monkeypatch, privates):
    use_privates(monkeypatch, privates)
    _, got = by_loop([SmoothedStep()])
    assert same(got, by_hand(smoothed))
    assert not same(got, by_hand(F.cross_entropy))


@PRIVATES
def test_a_wrapper_of_compute_loss_gets_the_loss_that_trains(monkeypatch, privates):
    use_privates(monkeypatch, privates)
    _, got = by_loop([Doubling(), SmoothedLoss()])  # the user's trylast loss, doubled
    assert same(got, by_hand(doubled(smoothed)))
    _, got = by_loop([Doubling()])  # no plugin answers: the default loss, doubled
    assert same(got, by_hand(doubled(F.cross_entropy)))


@PRIVATES
def test_a_trylast_loss_registered_after_the_loop_was_built_still_comes_first(monkeypatch, privates):
    use_privates(monkeypatch, privates)
    _, got = by_loop(added=[SmoothedLoss()])
    assert same(got, by_hand(smoothed))


@PRIVATES
def test_a_trylast_loss_for_one_gan_network_leaves_the_other_to_the_default(monkeypatch, privates):
    use_privates(monkeypatch, privates)
    asked, returned, trained = [], [], []

    class Hinge:
        """The discriminator's hinge loss; None for the generator: GANLoss answers."""

        @hookimpl(trylast=True)
        def compute_loss(self, network, outputs):
            asked.append(network.name)
            if network.name != "discriminator":
                return None
            real, fake = outputs["real"], outputs["fake"]
            returned.append(F.relu(1 - real).mean() + F.relu(1 + fake).mean())
            return returned[-1]

    class Losses:
        @hookimpl
        def after_step(self, loss):
            trained.append(loss)

    tiny_gan_loop([Hinge(), Losses()], n=32).fit(max_steps=2)
    assert asked == ["discriminator", "generator"] * 2
    assert all(a is b for a, b in zip([loss["discriminator"] for loss in trained], returned, strict=True))
    assert all(set(loss) == {"discriminator", "generator"} for loss in trained)  # GANLoss's


class TrylastLastRegisteredFirst(pluggy.HookCaller):
    """A pluggy that calls ``trylast`` implementations last registered first,
    as its documentation says of every kind (pluggy 1.7's code calls them the
    first registered first)."""

    def _add_hookimpl(self, hookimpl):
        super()._add_hookimpl(hookimpl)
        if not hookimpl.trylast:
            return
        impls = self._hookimpls  # pluggy calls it from its end
        impls.remove(hookimpl)  # pluggy put it first: called after the trylast ones before it
        wrapper = bool(hookimpl.wrapper or hookimpl.hookwrapper)
        earlier = [i for i, h in enumerate(impls)
                   if h.trylast and bool(h.wrapper or h.hookwrapper) == wrapper]
        if earlier:  # after them in the list: called before them
            impls.insert(earlier[-1] + 1, hookimpl)
        else:  # the first of its kind: where its kind (plain ones, wrappers) starts
            wrappers = [i for i, h in enumerate(impls) if h.wrapper or h.hookwrapper]
            impls.insert((wrappers[0] if wrappers else len(impls)) if wrapper else 0, hookimpl)


@pytest.fixture
def trylast_last_registered_first(monkeypatch):
    monkeypatch.setattr(pluggy._manager, "HookCaller", TrylastLastRegisteredFirst)
    plugin_manager.trylast_in_registration_order.cache_clear()
    yield
    monkeypatch.undo()
    plugin_manager.trylast_in_registration_order.cache_clear()


def test_with_a_pluggy_calling_trylast_the_other_way_the_defaults_still_answer_last(
        trylast_last_registered_first):
    assert plugin_manager.trylast_in_registration_order() is False
    loop, got = by_loop([SmoothedLoss()])
    assert isinstance(loop.plugins.pm.hook.compute_loss, TrylastLastRegisteredFirst)
    assert same(got, by_hand(smoothed))
    _, got = by_loop([SmoothedStep()])
    assert same(got, by_hand(smoothed))
    log = []

    def plugin(tag):
        class P:
            name = tag

            @hookimpl(trylast=True)
            def on_epoch_start(self):
                log.append(tag)

        return P()

    tiny_loop([plugin("C"), plugin("D")], n=8).fit(epochs=1)
    assert log == ["C", "D"]  # this pluggy's order: plugins=[...]'s
