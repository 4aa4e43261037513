"""A bad plugin fails at Loop(...) or names itself when it raises."""

import pytest
import torch

from hookloop import PluginLoadError, PluginValidationError, hookimpl
from hookloop.testing import tiny_loop


class Typo:
    @hookimpl
    def after_backwards(self, loop):
        pass


class UnknownArgument:
    @hookimpl
    def after_backward(self, loop, optimizer):
        pass


class Raising:
    @hookimpl
    def after_backward(self, loop, network):
        if loop.state.global_step == 2:
            raise ValueError("gradient went sideways")


class Unmarked:
    def on_epoch_end(self, loop):
        pass


def test_a_typo_in_a_hook_name_fails_at_construction_with_a_suggestion():
    with pytest.raises(PluginValidationError) as info:
        tiny_loop([Typo()])
    message = str(info.value)
    assert "plugin 'Typo'" in message
    assert "method 'after_backwards'" in message
    assert "Did you mean 'after_backward'?" in message
    assert "Valid hooks: on_loop_start, on_loop_end, on_fit_start" in message and "on_epoch_end" in message


def test_an_argument_the_hook_does_not_have_fails_at_construction():
    with pytest.raises(PluginValidationError) as info:
        tiny_loop([UnknownArgument()])
    message = str(info.value)
    assert "plugin 'UnknownArgument'" in message and "method 'after_backward'" in message
    assert "'optimizer'" in message and "Valid arguments: loop, network" in message


def test_a_class_instead_of_an_instance_is_refused():
    with pytest.raises(PluginValidationError, match=r"GradClip\(\.\.\.\) instead"):
        from hookloop.plugins import GradClip

        tiny_loop([GradClip])


def test_a_plugin_without_hookimpls_is_refused_with_a_hint():
    with pytest.raises(PluginValidationError, match=r"no @hookimpl methods.*on_epoch_end"):
        tiny_loop([Unmarked()])


def test_nothing_trains_when_a_plugin_is_refused():
    calls = []

    class Watch:
        @hookimpl
        def on_fit_start(self):
            calls.append(1)

    with pytest.raises(PluginValidationError):
        tiny_loop([Watch(), Typo()])
    assert calls == []


def test_two_plugins_with_one_name_are_refused_naming_both_sources():
    class A:
        def __init__(self, name):
            self.name = name  # an explicit name: kept, so two alike clash

        @hookimpl
        def on_fit_start(self):
            pass

    with pytest.raises(PluginValidationError, match="two plugins are named 'same'"):
        tiny_loop([A("same"), A("same")])


def test_an_exception_in_a_hookimpl_names_the_plugin_and_the_hook():
    seen = []

    class Cleanup:
        @hookimpl
        def on_exception(self, exception):
            seen.append(exception)

    loop = tiny_loop([Raising(), Cleanup()])
    with pytest.raises(ValueError) as info:  # the plugin's own exception, not a wrapper
        loop.fit(epochs=1)
    assert type(info.value) is ValueError and str(info.value) == "gradient went sideways"
    assert info.value.__notes__ == [
        "hookloop: raised in hook 'after_backward' of plugin 'Raising' (code, plugins[0])"
    ]
    assert len(seen) == 1 and seen[0] is info.value
    assert loop.state.global_step == 2


def test_the_culprit_is_the_instance_that_raised_not_its_twin():
    class Flaky:
        def __init__(self, name, fail):
            self.name, self.fail = name, fail

        @hookimpl
        def on_epoch_start(self):
            if self.fail:
                raise RuntimeError("no")

    with pytest.raises(RuntimeError, match="raised in hook 'on_epoch_start' of plugin 'second'"):
        tiny_loop([Flaky("first", False), Flaky("second", True)]).fit(epochs=1)


def test_a_compute_loss_returning_a_non_tensor_is_named():
    class FloatLoss:
        @hookimpl
        def compute_loss(self):
            return 0.5

    with pytest.raises(TypeError) as info:
        tiny_loop([FloatLoss()]).fit(epochs=1)
    cause = info.value
    assert "compute_loss returned float for network 'model'" in str(cause)
    assert "FloatLoss" in str(cause)


def test_an_unknown_plugin_name_lists_the_known_ones():
    with pytest.raises(PluginLoadError, match="no plugin named 'nope'.*gradclip"):
        tiny_loop(["nope"])


def test_a_model_without_loss_or_targets_gets_a_clear_error():
    from torch.utils.data import DataLoader

    from hookloop import Loop

    model = torch.nn.Linear(4, 2)
    loop = Loop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                train_data=DataLoader(torch.randn(8, 4), batch_size=4), block=["progress"])
    with pytest.raises(ValueError, match="raised in hook 'compute_loss'") as info:
        loop.fit(epochs=1)
    assert "model returned no loss and the batch has no targets" in str(info.value)
