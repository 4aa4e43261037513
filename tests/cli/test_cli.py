"""The hookloop command: plugins and hooks."""

import json
import subprocess
import sys

from hookloop import hookspecs
from hookloop.cli import main
from hookloop.manager import hook_names


def test_hooks_prints_the_reference_of_every_hook(capsys):
    assert main(["hooks"]) == 0
    out = capsys.readouterr().out
    for name in hook_names():
        assert f"\n{name}(" in out
        first_line = getattr(hookspecs, name).__doc__.strip().splitlines()[0]
        assert first_line in out
    assert "compute_loss(loop, network, batch, outputs) (firstresult)" in out


def test_plugins_json_lists_the_builtins_with_their_hooks(capsys):
    assert main(["plugins", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["loss"]["hooks"] == ["compute_loss"] and rows["loss"]["status"] == "active"
    assert rows["progress"]["status"] == "active"
    assert rows["logger"]["status"] == "available"
    assert all(r["source"] == "built-in" for r in rows.values() if r["distribution"] == "hookloop")


def test_plugins_filters_by_hook(capsys):
    main(["plugins", "--hook", "after_backward"])
    out = capsys.readouterr().out
    assert "gradclip" in out and "logger" not in out


def test_the_console_script_is_installed():
    out = subprocess.run([sys.executable, "-m", "hookloop.cli", "--version"],
                         capture_output=True, text=True, check=True).stdout
    assert out.startswith("hookloop ")


def test_an_unknown_demo_is_refused(capsys):
    assert main(["demo", "nope"]) == 2
    assert "unknown demo 'nope'" in capsys.readouterr().err


def test_tracing_prints_every_hook_call_with_its_plugins(monkeypatch, capsys):
    from hookloop.testing import tiny_loop

    monkeypatch.setenv("HOOKLOOP_TRACE", "1")
    tiny_loop(n=8).fit(epochs=1)
    err = capsys.readouterr().err
    assert "[hookloop] training_step -> supervised" in err
    assert "[hookloop] compute_loss -> loss" in err


def test_demo_options_without_a_name_go_to_the_default_demo(monkeypatch):
    import hookloop.cli as cli

    seen = []
    monkeypatch.setitem(cli.DEMOS, "gan", "digits_classifier")
    import hookloop.examples.digits_classifier as demo

    monkeypatch.setattr(demo, "main", lambda argv: seen.append(list(argv)) or 0)
    assert cli.main(["demo", "--epochs", "3"]) == 0
    assert seen == [["--epochs", "3"]]
