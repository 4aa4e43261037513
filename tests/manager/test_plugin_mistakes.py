"""Mistakes a plugin author makes that used to pass silently or blame the wrong
party (issue 13, section 3): each is refused or reported at ``Loop(...)``, or
names the plugin that made it."""

import warnings

import pytest
import torch

from hookloop import PluginValidationError, hookimpl
from hookloop.manager import FOREIGN_HOOKS, UnmarkedHookWarning, hook_names, suggest_hook
from hookloop.plugins import GradClip
from hookloop.testing import tiny_loop


# -- one method named like a hook left unmarked ---------------------------------------


class HalfMarked:
    @hookimpl
    def after_step(self, loop):
        pass

    def on_epoch_end(self, loop, metrics):  # forgot @hookimpl
        pass


def test_an_unmarked_hook_method_next_to_marked_ones_is_warned_about_by_name():
    with pytest.warns(UnmarkedHookWarning) as record:
        tiny_loop([HalfMarked()])
    (warning,) = [w for w in record if issubclass(w.category, UnmarkedHookWarning)]
    message = str(warning.message)
    assert "plugin 'HalfMarked'" in message and "method 'on_epoch_end'" in message
    assert "never called" in message and "@hookimpl" in message


def test_fully_marked_plugins_and_the_built_ins_warn_nothing():
    class Fine:
        @hookimpl
        def after_step(self, loop):
            pass

        def helper(self):  # not named like a hook
            pass

    with warnings.catch_warnings():
        warnings.simplefilter("error", UnmarkedHookWarning)
        tiny_loop([Fine(), GradClip(max_norm=1.0)], eval_data=True)


# -- wrapper=True without yield ----------------------------------------------------------


def test_a_wrapper_without_yield_is_a_validation_error_naming_plugin_and_hook():
    class NoYield:
        @hookimpl(wrapper=True)
        def after_backward(self, loop, network):
            return None

    with pytest.raises(PluginValidationError) as info:
        tiny_loop([NoYield()])
    message = str(info.value)
    assert "plugin 'NoYield'" in message and "method 'after_backward'" in message
    assert "wrapper=True" in message and "yield" in message


def test_a_wrapper_with_yield_is_fine():
    seen = []

    class Timing:
        @hookimpl(wrapper=True)
        def training_step(self, loop, batch):
            result = yield
            seen.append(type(result).__name__)
            return result

    tiny_loop([Timing()]).fit(max_steps=2)
    assert seen == ["StepOutput", "StepOutput"]


# -- state_dict without load_state_dict -----------------------------------------------------


@pytest.mark.parametrize("present,missing", [("state_dict", "load_state_dict"),
                                             ("load_state_dict", "state_dict")])
def test_half_of_the_state_pair_is_refused(present, missing):
    def method(self, *args):
        return {}

    cls = type("HalfState", (), {
        "on_fit_start": hookimpl(lambda self, loop: None),
        present: method,
    })
    with pytest.raises(PluginValidationError) as info:
        tiny_loop([cls()])
    message = str(info.value)
    assert "plugin 'HalfState'" in message
    assert f"has {present}() but no {missing}()" in message


# -- **kwargs / *args in a hook implementation --------------------------------------------


@pytest.mark.parametrize("signature", ["self, loop, **kwargs", "self, *args"])
def test_star_arguments_in_a_hookimpl_are_refused(signature):
    namespace = {}
    exec(f"def after_step({signature}):\n    pass\n", namespace)
    cls = type("Stars", (), {"after_step": hookimpl(namespace["after_step"])})
    with pytest.raises(PluginValidationError) as info:
        tiny_loop([cls()])
    message = str(info.value)
    assert "plugin 'Stars'" in message and "method 'after_step'" in message
    assert "always be empty" in message and "loop, batch, outputs, loss" in message


# -- the same object twice, and duplicate names ----------------------------------------------


def test_the_same_object_given_twice_says_so():
    clip = GradClip(max_norm=1.0)
    with pytest.raises(PluginValidationError, match=r"'gradclip' is given twice \(the same object\)"):
        tiny_loop([clip, clip])


def test_two_objects_with_one_name_name_their_sources():
    class A:
        def __init__(self, name):
            self.name = name  # an instance's own name is kept as given

        @hookimpl
        def on_fit_start(self):
            pass

    with pytest.raises(PluginValidationError) as info:
        tiny_loop([A("same"), A("same")])
    assert "two plugins are named 'same': one from code, plugins[1], one from code, plugins[0]" in str(info.value)


# -- names from Lightning and the Hugging Face Trainer --------------------------------------


@pytest.mark.parametrize("foreign,ours", [
    ("on_train_batch_end", "after_step"),
    ("training_step_end", "after_step"),
    ("on_before_optimizer_step", "before_optimizer_step"),
    ("on_after_backward", "after_backward"),
    ("on_train_start", "on_fit_start"),
    ("on_step_end", "after_step"),
])
def test_a_lightning_or_trainer_hook_name_suggests_the_hookloop_hook(foreign, ours):
    cls = type("Ported", (), {foreign: hookimpl(lambda self, loop: None)})
    with pytest.raises(PluginValidationError) as info:
        tiny_loop([cls()])
    message = str(info.value)
    assert f"'{foreign}' is " in message and f"the hookloop hook is '{ours}'" in message
    assert "Did you mean" not in message


def test_every_foreign_name_maps_to_a_hook_or_the_state_methods():
    """Each entry of the table names a real hook (or state_dict/load_state_dict),
    and no entry shadows a hookloop hook of the same name."""
    hooks = set(hook_names())
    for foreign, (library, ours) in FOREIGN_HOOKS.items():
        assert foreign not in hooks, foreign
        assert library in ("Lightning", "the Hugging Face Trainer")
        assert ours in hooks or ours in ("state_dict", "load_state_dict"), (foreign, ours)
        assert suggest_hook(foreign), foreign


def test_the_validation_epoch_end_name_maps_to_on_eval_end():
    assert "'on_eval_end'" in suggest_hook("on_validation_epoch_end")
    assert "state_dict()" in suggest_hook("on_save_checkpoint")
    assert suggest_hook("after_backwards") == " Did you mean 'after_backward'?"


# -- what compute_loss returns ---------------------------------------------------------------


def _raised_by(loop):
    """The exception fit() raises, and the plugin the loop's attribution names."""
    with pytest.raises(Exception) as info:
        loop.fit(epochs=1)
    exc = info.value
    cause = exc.__cause__ if type(exc).__name__ == "HookError" else exc
    return exc, cause, loop.plugins.culprit(cause)


class PerExample:
    @hookimpl
    def compute_loss(self, batch, outputs):
        return torch.nn.functional.cross_entropy(outputs, batch[1], reduction="none")


class Detached:
    @hookimpl
    def compute_loss(self, batch, outputs):
        return torch.nn.functional.cross_entropy(outputs, batch[1]).detach()


class FloatLoss:
    @hookimpl
    def compute_loss(self, batch, outputs):
        return torch.nn.functional.cross_entropy(outputs, batch[1]).item()


class OnlyForOthers:
    """Answers for another network: must not be blamed."""

    @hookimpl
    def compute_loss(self, network):
        return None if network.name == "model" else 0.0


@pytest.mark.parametrize("plugin,kind,words", [
    (PerExample(), ValueError, "a tensor of shape (8,), not a scalar"),
    (Detached(), ValueError, "does not require grad"),
    (FloatLoss(), TypeError, "compute_loss returned float for network 'model'"),
])
def test_a_bad_loss_names_the_plugin_that_returned_it_and_what_is_wrong(plugin, kind, words):
    name = type(plugin).__name__
    exc, cause, culprit = _raised_by(tiny_loop([OnlyForOthers(), plugin]))
    assert isinstance(cause, kind)
    message = str(cause)
    assert words in message and f"plugin {name!r}" in message
    assert "OnlyForOthers" not in message and "supervised" not in message
    assert culprit == (name, "compute_loss")  # the headline (note or HookError) names it too
    assert "supervised" not in str(exc).split("\n")[0]


def test_a_loss_nobody_returns_lists_the_compute_loss_plugins():
    loop = tiny_loop([OnlyForOthers()], block=["loss", "progress"])
    _, cause, _ = _raised_by(loop)
    assert isinstance(cause, TypeError)
    assert "compute_loss returned NoneType for network 'model'" in str(cause)
    assert "OnlyForOthers" in str(cause)


def test_the_default_loss_path_pays_nothing_for_the_checks():
    """A good loss goes to backward untouched: no second compute_loss call."""
    calls = []

    class Counting:
        @hookimpl
        def compute_loss(self, batch, outputs):
            calls.append(1)
            return torch.nn.functional.cross_entropy(outputs, batch[1])

    tiny_loop([Counting()]).fit(epochs=1)
    assert len(calls) == 8


# -- what eval_step returns ----------------------------------------------------------------


class ListEval:
    @hookimpl
    def eval_step(self, loop, batch):
        return [0.5, 0.7]


def _fit_with(plugin):
    trained = []

    class Count:
        @hookimpl
        def before_step(self):
            trained.append(1)

    loop = tiny_loop([plugin, Count()], eval_data=True)
    with pytest.raises(Exception) as info:
        loop.fit(epochs=1)
    return info.value, trained


def test_an_unusable_eval_step_result_fails_at_the_sanity_check_before_training():
    exc, trained = _fit_with(ListEval())
    assert trained == []  # found in seconds, not after an epoch
    assert not isinstance(exc, AttributeError)


def test_an_eval_step_returning_nothing_names_the_strategy_before_training():
    """The GAN strategy has no eval_step: evaluating it fails at the sanity check."""
    from hookloop.testing import tiny_gan_loop

    trained = []

    class Count:
        @hookimpl
        def before_step(self):
            trained.append(1)

    gan = tiny_gan_loop([Count()])
    gan.eval_data = gan.train_data
    with pytest.raises(TypeError, match="no plugin returned a result from eval_step for strategy 'gan'"):
        gan.fit(epochs=1)
    assert trained == []


def test_an_unusable_eval_step_result_names_the_plugin_that_returned_it():
    exc, _ = _fit_with(ListEval())
    assert "ListEval" in str(exc) and "eval_step" in str(exc)


def test_a_name_the_user_gave_twice_says_where_in_the_plugins_list():
    with pytest.raises(PluginValidationError) as info:
        tiny_loop([("gradclip", {"name": "x", "max_norm": 1.0}), ("logger", {"name": "x"})])
    message = str(info.value)
    assert "plugins[0]" in message and "plugins[1]" in message
    assert "both from built-in" not in message


# -- a class given instead of an instance: named as itself, with the fix -----------------------


class Unnamed:
    """A plugin class without a ``name`` attribute: named after its class."""

    @hookimpl
    def after_step(self, loop):
        pass


def test_a_plugin_class_in_plugins_is_named_as_the_class_not_type():
    with pytest.raises(PluginValidationError) as info:
        tiny_loop([Unnamed])
    message = str(info.value)
    assert "'type'" not in message
    assert message.startswith("plugin 'Unnamed' is the class ")
    assert "Unnamed, not an instance: pass Unnamed(...) instead" in message


def test_a_built_in_plugin_class_in_plugins_says_to_pass_an_instance():
    with pytest.raises(PluginValidationError) as info:
        tiny_loop([GradClip])
    message = str(info.value)
    assert "'type'" not in message
    assert "hookloop.plugins.gradclip.GradClip, not an instance: pass GradClip(...) instead" in message


def test_a_class_given_to_register_is_named_as_the_class():
    from hookloop.manager import plugin_name
    from hookloop.testing import registered

    assert plugin_name(Unnamed) == "Unnamed" and plugin_name(Unnamed()) == "Unnamed"
    loop = tiny_loop()
    with pytest.raises(PluginValidationError) as info:
        with registered(loop, Unnamed):
            pass
    message = str(info.value)
    assert "'type'" not in message and message.startswith("plugin 'Unnamed' is the class ")
    assert "pass Unnamed(...) instead" in message
    assert "Unnamed" not in loop.plugins.names()


def test_a_class_next_to_an_instance_of_it_is_named_and_refused():
    with pytest.raises(PluginValidationError) as info:
        tiny_loop([Unnamed(), Unnamed])
    message = str(info.value)
    assert "'type" not in message and "pass Unnamed(...) instead" in message


def test_a_class_with_options_in_the_by_name_form_says_to_pass_the_instance():
    with pytest.raises(PluginValidationError) as info:
        tiny_loop([(GradClip, {"max_norm": 1.0})])
    message = str(info.value)
    assert "<class" not in message
    assert message == ("plugin given as (GradClip, {'max_norm': 1.0}): a (name, options) pair takes "
                       "the plugin's name, not its class: pass the instance GradClip(max_norm=1.0)")


# -- changes_training: the guide's example, as the autoload rule and `hookloop plugins` read it ----


def _guide_changes_training_block():
    import re

    from paths import ROOT

    text = (ROOT / "docs" / "plugins.md").read_text()
    body = text.split("\n## Switched on, or only installed\n", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", body, flags=re.S)
    assert "changes_training" in body and "never autoloads" in body
    return code


def test_the_guide_s_changes_training_example_is_read_as_it_says():
    from importlib import metadata

    from hookloop.cli import CHANGES_TRAINING
    from hookloop.discovery import Installed, autoload_decision, changes_training

    namespace = {"hookimpl": hookimpl, "torch": torch}
    exec(compile(_guide_changes_training_block(), "docs/plugins.md:changes_training", "exec"), namespace)
    observer, changer = namespace["GradNormLogger"], namespace["LabelSmoothing"]
    assert changes_training(observer) is False and changes_training(changer) is True
    assert CHANGES_TRAINING[changes_training(observer)] == "no (an observer)"
    assert CHANGES_TRAINING[changes_training(changer)] == "yes"

    def installed(cls):
        entry = metadata.EntryPoint(name="x", value=f"somewhere:{cls.__name__}", group="hookloop")
        return Installed(name="x", entry_point=entry, distribution="hookloop-x", version="0.1", obj=cls)

    import os
    from unittest import mock

    with mock.patch.dict(os.environ, {}, clear=False):
        for variable in ("HOOKLOOP_DISABLE_PLUGIN_AUTOLOAD", "HOOKLOOP_LOAD_PLUGINS", "HOOKLOOP_BLOCK_PLUGINS"):
            os.environ.pop(variable, None)
        assert autoload_decision(installed(observer)) == (True, "observer: its author set autoload = True")
        assert autoload_decision(installed(changer))[0] is False
        changer.autoload = True  # even so: a plugin that changes training never autoloads
        active, why = autoload_decision(installed(changer))
        assert not active and "never autoloads" in why

    # both are valid plugins; named, the loss plugin changes the numbers, the observer none
    from hookloop.testing import parameters, reset_accelerate

    runs = {}
    for name, plugins in (("plain", []), ("observer", [observer()]), ("changer", [changer(0.2)])):
        reset_accelerate()
        loop = tiny_loop(plugins)
        loop.fit(max_steps=3)
        runs[name] = parameters(loop)
    assert all(torch.equal(a, b) for a, b in zip(runs["plain"], runs["observer"]))
    assert not all(torch.equal(a, b) for a, b in zip(runs["plain"], runs["changer"]))
