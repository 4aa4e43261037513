"""``hookloop new-plugin NAME``: what it writes and what it refuses. That the
output installs and its tests pass is shown in a real virtual environment by
tests/test_plugin_distributions.py."""

import importlib
import importlib.util
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
    # the recipe installs the `test` extra: its tests run in a fresh environment (0.4: "pytest:
    # command not found" unless the user knew to install it)
    assert [dep for dep in project["optional-dependencies"]["test"] if dep.startswith("pytest")]
    for written in ("README.md", "tests/test_demo_thing.py"):
        assert "pip install './hookloop-demo-thing[test]'" in (root / written).read_text(), written

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


def _import_generated(root):
    """The generated plugin module and its test module, imported fresh."""
    for name in ("hookloop_demo_thing", "test_demo_thing"):
        sys.modules.pop(name, None)
    module = importlib.import_module("hookloop_demo_thing")
    spec = importlib.util.spec_from_file_location("test_demo_thing", root / "tests" / "test_demo_thing.py")
    tests = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tests)
    return module, tests


def test_the_generated_plugin_acts_once_per_update_under_accumulation_and_its_test_checks_it(tmp_path):
    """Under Accelerator(gradient_accumulation_steps=2) global_step stays the
    same for both batches of a group: the generated after_step acts only
    where loop.accelerator.sync_gradients is true, and the generated test
    fails for a plugin that does not check it (the pattern the guide warns
    against: "every N steps" firing twice per update)."""
    from accelerate import Accelerator

    from hookloop.testing import HookRecorder, reset_accelerate

    root = write("demo-thing", tmp_path)
    source_path = root / "src" / "hookloop_demo_thing" / "__init__.py"
    source = source_path.read_text()
    assert "if not loop.accelerator.sync_gradients:\n            return\n" in source
    sys.path.insert(0, str(root / "src"))
    try:
        module, tests = _import_generated(root)
        reset_accelerate()
        plugin = module.DemoThing(every=2)
        tiny_loop([plugin], accelerator=Accelerator(gradient_accumulation_steps=2)).fit(epochs=1)
        assert [step for step, _ in plugin.losses] == [2, 4]  # 8 batches, 4 updates

        reset_accelerate()
        tests.test_counts_updates_under_gradient_accumulation(tiny_loop=tiny_loop,
                                                              hookloop_recorder=HookRecorder())

        # the template without the check (hookloop 0.2's): the generated test catches it
        source_path.write_text(source.replace(
            "        if not loop.accelerator.sync_gradients:\n            return\n", ""))
        module, tests = _import_generated(root)
        reset_accelerate()
        with pytest.raises(AssertionError):
            tests.test_counts_updates_under_gradient_accumulation(tiny_loop=tiny_loop,
                                                                  hookloop_recorder=HookRecorder())
    finally:
        sys.path.remove(str(root / "src"))
        for name in ("hookloop_demo_thing", "test_demo_thing"):
            sys.modules.pop(name, None)
        reset_accelerate()


def test_the_command_writes_refuses_to_overwrite_and_rejects_bad_names(tmp_path, capsys):
    assert main(["new-plugin", "demo-thing", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {tmp_path / 'hookloop-demo-thing' / 'pyproject.toml'}" in out
    assert f"next: pip install '{tmp_path / 'hookloop-demo-thing'}[test]'" in out
    before = (tmp_path / "hookloop-demo-thing" / "pyproject.toml").read_text()

    assert main(["new-plugin", "demo-thing", "--dir", str(tmp_path)]) == 1
    assert "already exists" in capsys.readouterr().err
    assert (tmp_path / "hookloop-demo-thing" / "pyproject.toml").read_text() == before

    assert main(["new-plugin", "Demo_Thing", "--dir", str(tmp_path)]) == 2
    assert "plugin name 'Demo_Thing'" in capsys.readouterr().err
    assert not (tmp_path / "hookloop-Demo_Thing").exists()


def test_the_next_line_installs_the_folder_not_a_name_from_the_index(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["new-plugin", "demo-thing"]) == 0
    out = capsys.readouterr().out
    # without ./ pip would look the name up on the package index
    # quoted: zsh would glob the brackets of the test extra
    assert "next: pip install './hookloop-demo-thing[test]' && pytest hookloop-demo-thing/tests" in out
    assert main(["new-plugin", "other", "--dir", "sub dir"]) == 0
    assert "next: pip install './sub dir/hookloop-other[test]'" in capsys.readouterr().out


def test_the_command_s_help_gives_the_recipe_with_the_test_extra(capsys):
    with pytest.raises(SystemExit):
        main(["new-plugin", "--help"])
    said = " ".join(capsys.readouterr().out.split())  # (argparse wraps it to the terminal's width)
    assert "pip install './hookloop-NAME[test]' && pytest hookloop-NAME/tests (the test extra brings pytest)" in said


def _install_without_pip(root, site):
    """What ``pip install`` leaves for importlib.metadata: a dist-info folder
    with the entry points, on a path the test process imports from."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    info = site / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\n"
                                   f"Version: {project['version']}\n")
    lines = ["[hookloop]", *(f"{k} = {v}" for k, v in project["entry-points"]["hookloop"].items())]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")


def _run_generated_tests(root, site):
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(root / "src")])}
    env.pop("HOOKLOOP_DISABLE_PLUGIN_AUTOLOAD", None)  # as on a user's machine
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(root / "tests")], capture_output=True, text=True, env=env,
                          cwd=root, timeout=300)


@pytest.mark.slow  # two pytest runs in subprocesses, ~10 s each
def test_the_generated_test_fails_when_the_plugin_autoloads(tmp_path):
    """The generated distribution's own tests pass as written, and its
    'acts only when named' test catches a plugin that sets autoload = True."""
    root = write("demo-thing", tmp_path)
    _install_without_pip(root, tmp_path / "site")
    passed = _run_generated_tests(root, tmp_path / "site")
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert "3 passed" in passed.stdout

    module = root / "src" / "hookloop_demo_thing" / "__init__.py"
    source = module.read_text()
    assert "    autoload = False\n" in source
    module.write_text(source.replace("    autoload = False\n", "    autoload = True\n"))
    failed = _run_generated_tests(root, tmp_path / "site")
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "1 failed, 2 passed" in failed.stdout
    assert "test_installed_it_acts_only_when_named" in failed.stdout
    assert "the plugin loads without being named" in failed.stdout
