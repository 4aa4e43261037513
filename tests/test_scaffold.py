"""``hookloop new-plugin NAME``: what it writes and what it refuses. That the
output installs and its tests pass is shown in a real virtual environment by
tests/test_plugin_distributions.py."""

import importlib
import sys

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

from hookloop.cli import main
from hookloop.manager import implemented_hooks, validate
from hookloop.scaffold import names, write
from hookloop.testing import tiny_loop


def test_names_follow_from_the_plugin_name():
    assert names("demo-thing") == {
        "name": "demo-thing", "distribution": "hookloop-demo-thing", "module": "hookloop_demo_thing",
        "cls": "DemoThing", "test": "test_demo_thing.py", "hookloop_version": names("x")["hookloop_version"],
    }


@pytest.mark.parametrize("bad", ["Demo", "demo_thing", "demo--thing", "-demo", "9lives", "demo thing", ""])
def test_invalid_names_are_refused_with_the_rule(bad):
    with pytest.raises(ValueError, match="lower-case letters and digits, words joined by single hyphens"):
        names(bad)


@pytest.mark.parametrize("taken", ["gradclip", "logger", "loss", "progress", "supervised"])
def test_names_of_built_ins_are_refused(taken):
    with pytest.raises(ValueError, match="taken by a built-in"):
        names(taken)


def test_the_distribution_declares_the_entry_point_and_the_module_is_a_valid_plugin(tmp_path):
    root = write("demo-thing", tmp_path)
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) == [
        "README.md", "pyproject.toml", "src/hookloop_demo_thing/__init__.py",
        "tests/test_demo_thing.py"]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert project["name"] == "hookloop-demo-thing"
    assert project["entry-points"]["hookloop"] == {"demo-thing": "hookloop_demo_thing:DemoThing"}
    assert any(dep.startswith("hookloop>=") for dep in project["dependencies"])

    sys.path.insert(0, str(root / "src"))
    try:
        module = importlib.import_module("hookloop_demo_thing")
        plugin = module.DemoThing(every=4)
        validate(plugin, "demo-thing")  # what Loop(...) checks
        assert plugin.name == "demo-thing" and plugin.autoload is False
        assert implemented_hooks(plugin) == ["after_step"]
        assert module.DemoThing.after_step.__doc__  # the hookimpl is documented
        loop = tiny_loop([plugin])
        loop.fit(epochs=1)  # 8 steps
        assert [step for step, _ in plugin.losses] == [4, 8]
    finally:
        sys.path.remove(str(root / "src"))
        sys.modules.pop("hookloop_demo_thing", None)
    test_source = (root / "tests" / "test_demo_thing.py").read_text()
    compile(test_source, "test_demo_thing.py", "exec")
    assert "tiny_loop" in test_source and "hookloop_recorder" in test_source


def test_the_command_writes_refuses_to_overwrite_and_rejects_bad_names(tmp_path, capsys):
    assert main(["new-plugin", "demo-thing", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {tmp_path / 'hookloop-demo-thing' / 'pyproject.toml'}" in out
    assert f"next: pip install {tmp_path / 'hookloop-demo-thing'}" in out
    before = (tmp_path / "hookloop-demo-thing" / "pyproject.toml").read_text()

    assert main(["new-plugin", "demo-thing", "--dir", str(tmp_path)]) == 1
    assert "already exists" in capsys.readouterr().err
    assert (tmp_path / "hookloop-demo-thing" / "pyproject.toml").read_text() == before

    assert main(["new-plugin", "Demo_Thing", "--dir", str(tmp_path)]) == 2
    assert "plugin name 'Demo_Thing'" in capsys.readouterr().err
    assert not (tmp_path / "hookloop-Demo_Thing").exists()
