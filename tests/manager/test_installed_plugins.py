"""Installed plugins (entry-point group ``hookloop``): listed always, active
only when switched on, controlled by environment variables.

Each test lays a real distribution (a ``*.dist-info`` with ``entry_points.txt``
and its module) in a folder on ``sys.path``: importlib.metadata finds it
exactly as it finds a pip-installed one.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from hookloop import PluginLoadError
from hookloop.cli import plugin_rows
from hookloop.testing import tiny_loop

OBSERVER = '''
from hookloop import hookimpl

class Counter:
    """Counts steps; only observes, so its author lets it autoload."""
    autoload = True
    def __init__(self):
        self.steps = 0
    @hookimpl
    def after_step(self):
        self.steps += 1
'''

CHANGER = '''
from hookloop import hookimpl

class Halve:
    """Halves the loss: changes training, so acts only when named."""
    def __init__(self, factor=0.5):
        self.factor = factor
    @hookimpl
    def compute_loss(self, batch, outputs):
        import torch.nn.functional as F
        return self.factor * F.cross_entropy(outputs, batch[1])
'''


def install(root, dist, module, source, entry_points):
    root.mkdir(exist_ok=True)
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist.replace('-', '_')}-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.2.3\n")
    lines = "\n".join(f"{name} = {module}:{obj}" for name, obj in entry_points.items())
    (info / "entry_points.txt").write_text(f"[hookloop]\n{lines}\n")


@pytest.fixture
def site(tmp_path, monkeypatch):
    root = tmp_path / "site"
    install(root, "hookloop-counter", "hl_counter", OBSERVER, {"counter": "Counter"})
    install(root, "hookloop-halve", "hl_halve", CHANGER, {"halve": "Halve"})
    install(root, "hookloop-broken", "hl_broken", "raise ImportError('missing dependency xyz')\n",
            {"broken": "Thing"})
    monkeypatch.syspath_prepend(str(root))
    for var in ("HOOKLOOP_DISABLE_PLUGIN_AUTOLOAD", "HOOKLOOP_LOAD_PLUGINS", "HOOKLOOP_BLOCK_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    yield root
    for module in ("hl_counter", "hl_halve", "hl_broken"):
        sys.modules.pop(module, None)


def rows_by_name():
    return {r["name"]: r for r in plugin_rows()}


def test_installed_plugins_are_listed_with_distribution_version_and_hooks(site):
    rows = rows_by_name()
    assert rows["counter"]["distribution"] == "hookloop-counter"
    assert rows["counter"]["version"] == "1.2.3"
    assert rows["counter"]["hooks"] == ["after_step"]
    assert rows["counter"]["status"] == "active"
    assert rows["halve"]["status"] == "installed"
    assert "acts only when named" in rows["halve"]["reason"]
    assert rows["broken"]["status"] == "error" and "missing dependency xyz" in rows["broken"]["reason"]


def test_an_installed_behaviour_changer_does_not_act_until_named(site):
    import torch

    with pytest.warns(RuntimeWarning, match="hookloop-broken"):
        plain = tiny_loop()
    assert "halve" not in plain.plugins.names()
    assert "counter" in plain.plugins.names()  # the observer autoloads
    plain.fit(epochs=1)
    assert plain.plugins.get("counter").steps == 8

    from hookloop.testing import reset_accelerate

    reset_accelerate()
    os.environ["HOOKLOOP_BLOCK_PLUGINS"] = "broken"
    try:
        named = tiny_loop([("halve", {"factor": 0.25})])
    finally:
        del os.environ["HOOKLOOP_BLOCK_PLUGINS"]
    assert named.plugins.get("halve").factor == 0.25
    named.fit(epochs=1)
    different = [not torch.equal(a, b) for a, b in zip(
        plain.networks["model"].unwrapped.parameters(), named.networks["model"].unwrapped.parameters())]
    assert any(different)


def test_autoload_can_be_switched_off(site, monkeypatch):
    monkeypatch.setenv("HOOKLOOP_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert rows_by_name()["counter"]["status"] == "installed"
    assert "counter" not in tiny_loop().plugins.names()
    assert "counter" in tiny_loop(["counter"]).plugins.names()  # naming it still works


def test_the_allow_list_limits_autoload_and_empty_means_none(site, monkeypatch):
    monkeypatch.setenv("HOOKLOOP_LOAD_PLUGINS", "")
    assert rows_by_name()["counter"]["status"] == "installed"
    monkeypatch.setenv("HOOKLOOP_LOAD_PLUGINS", "counter")
    assert rows_by_name()["counter"]["status"] == "active"


def test_blocking_by_name(site, monkeypatch):
    monkeypatch.setenv("HOOKLOOP_BLOCK_PLUGINS", "counter,broken")
    rows = rows_by_name()
    assert rows["counter"]["status"] == "blocked" and rows["broken"]["status"] == "blocked"
    assert "counter" not in tiny_loop().plugins.names()
    assert "counter" not in tiny_loop(block=[]).plugins.names()


def test_asking_for_a_broken_plugin_names_distribution_and_entry_point(site):
    with pytest.raises(PluginLoadError) as info:
        tiny_loop(["broken"])
    message = str(info.value)
    assert "'broken'" in message and "hookloop-broken 1.2.3" in message
    assert "hl_broken:Thing" in message and "missing dependency xyz" in message


def test_the_cli_lists_installed_plugins_as_json(site):
    env = {**os.environ, "PYTHONPATH": str(site)}
    env.pop("HOOKLOOP_DISABLE_PLUGIN_AUTOLOAD", None)
    out = subprocess.run([sys.executable, "-m", "hookloop.cli", "plugins", "--json"],
                         capture_output=True, text=True, env=env, check=True).stdout
    rows = {r["name"]: r for r in json.loads(out)}
    assert rows["counter"]["source"] == "entry point"
    assert rows["counter"]["object"] == "hl_counter:Counter"
    assert rows["gradclip"]["status"] == "available" and sorted(rows["gradclip"]["hooks"]) == [
        "after_backward", "first_nonfinite_update"]
    assert rows["supervised"]["status"] == "active"
