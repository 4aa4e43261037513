"""`hookloop plugins` shows whether each plugin changes training; every
`--help` is plain text."""

import json

import pytest

from hookloop import hookimpl
from hookloop.cli import DEMOS, main, plain
from hookloop.manager import Installed, autoload_decision, changes_training


def test_plugins_shows_whether_each_plugin_changes_training(capsys):
    assert main(["plugins", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["gradclip"]["changes_training"] is True
    assert rows["loss"]["changes_training"] is True
    assert rows["supervised"]["status"] == "active"
    assert rows["samples"]["changes_training"] is False
    assert rows["distillation"]["status"] == "available"
    assert "strategy=Distillation(...)" in rows["distillation"]["reason"]
    assert rows["metrics"]["status"] == "active"  # a default of the supervised strategy
    main(["plugins"])
    out = capsys.readouterr().out
    block = out.split("gradclip", 1)[1].split("\n\n", 1)[0]
    assert "changes training: yes" in block
    assert "changes training: no (an observer)" in out.split("samples", 1)[1]


class Observer:
    changes_training = False

    @hookimpl
    def after_step(self):
        pass


class Changer:
    changes_training = True

    @hookimpl
    def compute_loss(self):
        pass


class Silent:
    @hookimpl
    def after_step(self):
        pass


def _installed(obj, name="x"):
    from importlib.metadata import EntryPoint

    return Installed(name=name, entry_point=EntryPoint(name, "m:o", "hookloop"),
                     distribution="hookloop-x", version="1", obj=obj)


@pytest.mark.parametrize("obj,declared,active,reason", [
    (Observer, False, False, "observer (changes_training = False), but its author did not set autoload"),
    (Changer, True, False, "changes training: acts only when named"),
    (Silent, None, False, "declared neither autoload nor changes_training"),
    (type("Auto", (Observer,), {"autoload": True}), False, True, "observer: its author set autoload"),
    (type("AutoChanger", (Changer,), {"autoload": True}), True, False, "never autoloads"),
])
def test_the_reason_an_installed_plugin_is_off_follows_what_its_author_declared(
        monkeypatch, obj, declared, active, reason):
    monkeypatch.delenv("HOOKLOOP_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.delenv("HOOKLOOP_LOAD_PLUGINS", raising=False)
    monkeypatch.delenv("HOOKLOOP_BLOCK_PLUGINS", raising=False)
    item = _installed(obj)
    assert changes_training(obj) is declared and item.changes_training is declared
    got_active, why = autoload_decision(item)
    assert got_active is active and reason in why


def test_autoload_alone_declares_an_observer():
    assert changes_training(type("A", (), {"autoload": True})) is False
    assert changes_training(type("B", (), {"changes_training": "yes"})) is None  # not a bool


@pytest.mark.parametrize("argv", [["--help"], ["plugins", "--help"], ["hooks", "--help"],
                                  ["new-plugin", "--help"],
                                  *(["demo", name, "--help"] for name in DEMOS)])
def test_help_is_plain_text(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ")
    for markup in ("``", ":class:", ":func:", ":mod:", ":meth:"):
        assert markup not in out, (argv, markup)


def test_plain_removes_rest_markup():
    assert plain("The ``hookloop`` command, see :class:`~hookloop.Loop`") == (
        "The hookloop command, see hookloop.Loop")
