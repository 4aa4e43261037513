"""loop.hook calls plain implementations through generated functions: they
must do exactly what pluggy's own call does."""

from types import SimpleNamespace

import pluggy
import torch
import torch.nn.functional as F

from hookloop import hookimpl
from hookloop.manager import PluginManager
from hookloop.testing import tiny_loop


class Log:
    def __init__(self):
        self.calls = []


def manager(*plugins):
    pm = PluginManager()
    for plugin in plugins:
        pm.register(plugin, plugin.name, "test")
    return pm


LOOP = SimpleNamespace(state=SimpleNamespace(global_step=7))
NETWORK = SimpleNamespace(name="model")


def plugins(log):
    class First:
        name = "first"

        @hookimpl(tryfirst=True)
        def after_step(self, loss):  # a subset of the arguments
            log.calls.append(("first", loss))
            return "first"

        @hookimpl(tryfirst=True)
        def compute_loss(self, network):
            log.calls.append(("first-loss", network.name))  # returns None: the next one runs

    class Second:
        name = "second"

        @hookimpl
        def after_step(self, loop, batch, outputs, loss):
            log.calls.append(("second", batch))

        @hookimpl
        def compute_loss(self, outputs, batch):  # arguments in another order
            log.calls.append(("second-loss", batch))
            return outputs * 2

    class Last:
        name = "last"

        @hookimpl(trylast=True)
        def after_step(self, loop):
            log.calls.append(("last", loop.state.global_step))
            return 3

        @hookimpl(trylast=True)
        def compute_loss(self, loop):
            log.calls.append(("never", None))  # after a result: not called
            return 0

    return [First(), Second(), Last()]


def test_generated_callers_do_what_pluggy_does():
    log = Log()
    pm = manager(*plugins(log))
    kwargs = {"loop": LOOP, "batch": "b", "outputs": 5, "loss": "l"}
    assert not isinstance(pm.hook.after_step, pluggy.HookCaller)  # the generated one
    results = pm.hook.after_step(**kwargs)
    calls, log.calls = log.calls, []
    assert results == pm.pm.hook.after_step(**kwargs) == ["first", 3]
    assert calls == log.calls == [("first", "l"), ("second", "b"), ("last", 7)]
    log.calls = []
    kwargs = {"loop": LOOP, "network": NETWORK, "batch": "b", "outputs": 5}
    assert pm.hook.compute_loss(**kwargs) == pm.pm.hook.compute_loss(**kwargs) == 10
    assert log.calls[:2] == log.calls[2:] == [("first-loss", "model"), ("second-loss", "b")]


def test_extra_keywords_are_ignored_as_pluggy_does():
    log = Log()
    pm = manager(*plugins(log))
    pm.hook.after_step(loop=LOOP, batch=1, outputs=2, loss=3, extra="ignored")
    assert [c[0] for c in log.calls] == ["first", "second", "last"]


def test_a_wrapper_still_wraps_the_call():
    class Double:
        name = "double"

        @hookimpl(wrapper=True)
        def compute_loss(self):
            loss = yield
            return loss * 2

    loop = tiny_loop([Double()])
    x, y = next(iter(loop.train_data))
    outputs = loop.networks["model"].model(x)
    got = loop.hook.compute_loss(loop=loop, network=loop.networks["model"], batch=(x, y),
                                 outputs=outputs)
    assert torch.equal(got, 2 * F.cross_entropy(outputs, y))


def test_call_monitoring_sees_every_call():
    loop = tiny_loop()
    seen = []
    loop.plugins.pm.add_hookcall_monitoring(lambda name, impls, kwargs: seen.append(name),
                                            lambda *args: None)
    loop.fit(max_steps=1)
    assert {"training_step", "compute_loss"} <= set(seen)


UPDATE_HOOKS = ("before_optimizer_step", "after_optimizer_step", "before_scheduler_step",
                "after_scheduler_step", "before_zero_grad", "after_zero_grad")


def test_hooks_nobody_implements_are_left_out_until_a_plugin_implements_one():
    """The default per-step path skips the calls of the update and backward hooks
    (no default plugin implements them); a plugin registered between two fits
    gets every call of the one it implements."""
    loop = tiny_loop()
    assert loop.hook.unimplemented(UPDATE_HOOKS)
    assert loop.hook.unimplemented(("before_backward", "after_backward"))
    loop.fit(max_steps=2)

    class Count:
        name = "count"

        def __init__(self):
            self.calls = []

        @hookimpl
        def after_zero_grad(self, loop):
            self.calls.append(loop.state.global_step)

        @hookimpl
        def before_backward(self, loss):
            self.calls.append("backward")

    count = Count()
    loop.plugins.register(count, "count", "test")
    assert not loop.hook.unimplemented(UPDATE_HOOKS)
    loop.fit(max_steps=4)
    # zero_grad of update n runs before global_step counts it
    assert count.calls == ["backward", 2, "backward", 3]


def test_the_default_finite_check_implements_no_backward_hook():
    """FiniteCheck() has nothing to do after a backward: it is not called there
    (every step would pay for the call); FiniteCheck(action="skip") is."""
    from hookloop.plugins import FiniteCheck

    def implementers(finite):
        loop = tiny_loop([finite])  # replaces the default of the same name
        return [i.plugin_name for i in loop.plugins.pm.hook.after_backward.get_hookimpls()]

    assert "finite" not in implementers(FiniteCheck())
    assert "finite" in implementers(FiniteCheck(action="skip"))
