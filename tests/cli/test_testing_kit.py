"""hookloop.testing, the kit for plugin authors: it is a pytest plugin (these
tests use its fixtures without importing them), its loops are seeded, its
recorder sees every hook, and its isolation keeps installed plugins out."""

import os
import sys
import textwrap

import pytest
import torch

from hookloop import hookimpl
from hookloop.manager import hook_names
from hookloop.strategies import GAN
from hookloop.testing import (
    HookRecorder,
    no_installed_plugins,
    parameters,
    registered,
    reset_accelerate,
    tiny_gan_loop,
    tiny_loop,
)


def test_the_fixtures_come_from_the_pytest11_entry_point(request):
    from importlib import metadata

    (ep,) = [e for e in metadata.entry_points(group="pytest11") if e.name == "hookloop"]
    assert ep.value == "hookloop.testing"
    plugin = request.config.pluginmanager.get_plugin("hookloop")
    assert plugin is sys.modules["hookloop.testing"]


def test_tiny_gan_loop_trains_both_networks_and_is_seeded(tiny_gan_loop, hookloop_recorder):
    loop = tiny_gan_loop([hookloop_recorder])
    assert isinstance(loop.strategy, GAN) and set(loop.networks) == {"generator", "discriminator"}
    start = {n: parameters(loop, n) for n in loop.networks}
    loop.fit(max_steps=3)
    for name in loop.networks:
        assert not all(torch.equal(a, b) for a, b in zip(start[name], parameters(loop, name))), name
    steps = hookloop_recorder.calls_of("after_optimizer_step")
    assert [c["network"].name for c in steps] == ["discriminator", "generator"] * 3

    reset_accelerate()
    again = tiny_gan_loop()
    again.fit(max_steps=3)
    reset_accelerate()
    other_seed = tiny_gan_loop(seed=1)
    other_seed.fit(max_steps=3)
    for name in loop.networks:
        assert all(torch.equal(a, b) for a, b in zip(parameters(loop, name), parameters(again, name)))
        assert not all(torch.equal(a, b) for a, b in zip(parameters(loop, name), parameters(other_seed, name)))


def test_tiny_gan_loop_options(tiny_gan_loop):
    loop = tiny_gan_loop(n=32, batch_size=8, features=3, latent_dim=5, n_critic=2)
    assert len(loop.train_data) == 4 and loop.strategy.n_critic == 2
    assert loop.networks["generator"].unwrapped(torch.zeros(1, 5)).shape == (1, 3)


def test_the_recorder_records_every_hook_with_its_arguments(tiny_loop):
    recorder = HookRecorder()
    loop = tiny_loop([recorder], n=16, eval_data=True)
    loop.fit(epochs=1)
    seen = set(recorder.names())
    assert seen <= set(hook_names()) and "on_exception" not in seen
    assert {"on_fit_start", "on_epoch_start", "before_step", "training_step", "compute_loss",
            "before_backward", "after_backward", "after_optimizer_step", "after_step",
            "on_eval_start", "eval_step", "on_eval_end", "on_epoch_end", "on_fit_end"} <= seen
    assert recorder.count("training_step") == 2 == len(recorder.calls_of("after_step"))
    (end,) = recorder.calls_of("on_epoch_end")
    assert end["epoch"] == 0 and set(end["metrics"]) == {"eval_loss", "eval_accuracy"}
    only = HookRecorder(hooks=["after_step"])
    tiny_loop([only], n=16).fit(epochs=1)
    assert only.names() == ["after_step", "after_step"]
    only.clear()
    assert only.calls == []


def test_parameters_are_a_copy(tiny_loop):
    loop = tiny_loop()
    before = parameters(loop)
    loop.fit(max_steps=1)
    assert not all(torch.equal(a, b) for a, b in zip(before, parameters(loop)))


def test_registered_is_for_the_block_only(tiny_loop):
    class Count:
        name = "count"
        steps = 0

        @hookimpl
        def after_step(self):
            self.steps += 1

    loop = tiny_loop(n=16)
    with registered(loop, Count()) as count:
        assert "count" in loop.plugins.names()
        loop.fit(epochs=1)
    assert count.steps == 2 and "count" not in loop.plugins.names()


OBSERVER = '''
from hookloop import hookimpl

class Watch:
    autoload = True
    @hookimpl
    def on_fit_start(self):
        pass
'''


@pytest.fixture
def installed_observer(tmp_path, monkeypatch):
    """An installed distribution whose plugin autoloads (a dist-info on sys.path)."""
    (tmp_path / "kit_watch.py").write_text(textwrap.dedent(OBSERVER))
    info = tmp_path / "kit_watch-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kit-watch\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[hookloop]\nwatch = kit_watch:Watch\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for var in ("HOOKLOOP_DISABLE_PLUGIN_AUTOLOAD", "HOOKLOOP_LOAD_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOOKLOOP_BLOCK_PLUGINS", "something-else")
    yield
    sys.modules.pop("kit_watch", None)


def test_no_installed_plugins_keeps_observers_out_and_restores_the_environment(installed_observer):
    assert "watch" in tiny_loop().plugins.names()  # it autoloads
    with no_installed_plugins():
        reset_accelerate()
        assert "watch" not in tiny_loop().plugins.names()
        assert "watch" in tiny_loop(["watch"]).plugins.names()  # naming still works
        assert "HOOKLOOP_BLOCK_PLUGINS" not in os.environ
    assert "HOOKLOOP_DISABLE_PLUGIN_AUTOLOAD" not in os.environ
    assert os.environ["HOOKLOOP_BLOCK_PLUGINS"] == "something-else"


def test_the_loop_fixtures_are_isolated(installed_observer, request):
    factory = request.getfixturevalue("tiny_loop")  # set up after the observer is installed
    assert "watch" not in factory().plugins.names()
